"""Predictors (fmoe_cli/prediction) and the prefetcher that consumes them.

Synthetic routing with known structure, driven without a model:
- *copy*: every layer of a pass routes like the previous one (the residual stream
  barely changes), so the next router on this layer's hidden state is always right;
- *repeated patterns*: passes / requests drawn from a few fixed routings, so a
  predictor that remembers (expert maps, EAMs) is always right after seeing each once;
- *random*: independent routing everywhere, where nothing beats chance (K/N).
Then the engine: the prefetcher's ordering and budget, and exactness of every
predictor against transformers' generate.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
import torch
import transformers

from fmoe_cli.generate import stream_generate
from fmoe_cli.models.load import load_model
from fmoe_cli.offload.engine import Engine
from fmoe_cli.offload.link import PREFETCH, EmulatedLink, TransferState, VirtualClock
from fmoe_cli.offload.policies import FinemoePolicy, make_policy
from fmoe_cli.planning.presets import make_settings
from fmoe_cli.prediction import PREDICTORS
from fmoe_cli.prediction.auto import AutoPredictor
from fmoe_cli.prediction.base import BasePredictor, Iteration, Prediction
from fmoe_cli.prediction.eam import EamPredictor
from fmoe_cli.prediction.expert_map import ExpertMapPredictor
from fmoe_cli.prediction.make import make_predictor
from fmoe_cli.prediction.mol import MolPredictor
from fmoe_cli.prediction.speculative import SpeculativePredictor
from fmoe_cli.prediction.eam import EamCollection, normalise_rows
from fmoe_cli.prediction.expert_map import MapStore, prefetch_count
from fmoe_cli.prediction.mol import intersection_scores
from fmoe_cli.prediction.score import Scoreboard

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import families_survey  # noqa: E402 (benchmarks/: the families the survey serves exactly)

L, N, K, H = 6, 8, 2, 16
CHANCE = K / N


# --- a driver for synthetic routing ------------------------------------------------
class Driver:
    """Feeds passes to a predictor the way the engine does, and scores what it predicts."""

    def __init__(self, predictor, num_layers: int = L, routers=None) -> None:
        self.predictor = predictor
        self.it = Iteration(num_layers, N, routers)
        self.board = Scoreboard(num_layers, K)

    def run(self, passes) -> Scoreboard:
        """passes: (embedding [T, H'], hidden per layer ([T, H] or None), routed per layer [T, K])."""
        for embedding, hidden, routed in passes:
            self.it.begin(embedding)
            self.board.record(self.predictor.begin(self.it))
            for layer in range(self.it.num_layers):
                self.it.observe(layer, hidden[layer] if hidden is not None else None, routed[layer])
                self.board.score(self.it, layer)
                self.board.record(self.predictor.after_layer(self.it, layer))
        return self.board

    def fresh_board(self) -> None:
        self.board = Scoreboard(self.it.num_layers, K)


def identity_routers(num_layers: int = L) -> list[torch.nn.Module]:
    """Router l = 5·I on an N-dimensional hidden state: it picks the K largest coordinates."""
    routers = []
    for _ in range(num_layers):
        r = torch.nn.Linear(N, N, bias=False)
        with torch.no_grad():
            r.weight.copy_(5 * torch.eye(N))
        routers.append(r)
    return routers


def top_k(h: torch.Tensor) -> torch.Tensor:
    return torch.topk(h, K, dim=-1).indices


def copy_passes(n: int, seed: int = 0):
    """Decode passes whose hidden state is the same at every layer: layers copy each other."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        h = torch.randn(1, N, generator=g)
        out.append((torch.randn(1, H, generator=g), [h] * L, [top_k(h)] * L))
    return out


def random_passes(n: int, seed: int = 1, tokens: int = 1):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        hidden = [torch.randn(tokens, N, generator=g) for _ in range(L)]
        out.append((torch.randn(tokens, H, generator=g), hidden, [top_k(h) for h in hidden]))
    return out


def pattern_routing(count: int, seed: int = 2):
    """`count` fixed routings (one K-subset per layer; layer 0 differs between patterns)."""
    g = torch.Generator().manual_seed(seed)
    patterns = []
    for p in range(count):
        layers = [torch.tensor([[p % N, (p + 1 + p // N) % N]])]  # distinct layer-0 sets for count <= N
        layers += [torch.randperm(N, generator=g)[:K].reshape(1, K) for _ in range(L - 1)]
        patterns.append((torch.randn(1, H, generator=g), layers))
    return patterns


# --- speculative and mol --------------------------------------------------------------
@pytest.mark.parametrize("make", [SpeculativePredictor, MolPredictor])
def test_router_predictors_are_exact_when_layers_copy_and_chance_on_random(make):
    routers = identity_routers()
    board = Driver(make(routers), routers=routers).run(copy_passes(150))
    acc = board.accuracy()
    assert torch.all(acc[1:] == 1.0), acc  # layer l+1 copies layer l: the next router on h_l is right
    assert acc[0] < 0.6  # layer 0 follows a new token: nothing to copy
    board = Driver(make(routers), routers=routers).run(random_passes(300))
    acc = board.accuracy()
    assert 0.12 < float(acc.mean()) < 0.4, acc  # about K/N = 0.25, no worse


def test_speculative_uses_the_next_router_on_this_layers_hidden_state():
    """Distinct routers and distinct per-layer hidden states: the prediction for layer l+1 is
    softmax(R_{l+1}(h_l)), not R_l(h_l) (this layer's router) nor R_{l+1}(h_{l-1})."""
    from fmoe_cli.prediction.base import router_scores

    g = torch.Generator().manual_seed(11)
    routers = []
    for _ in range(L):
        r = torch.nn.Linear(N, N, bias=False)
        with torch.no_grad():
            r.weight.copy_(torch.randn(N, N, generator=g) * 3)
        routers.append(r)
    hidden = [torch.randn(3, N, generator=g) for _ in range(L)]
    it = Iteration(L, N, routers)
    it.begin(torch.zeros(3, H))
    predictor = SpeculativePredictor(routers)
    for layer in range(L):
        it.observe(layer, hidden[layer], top_k(hidden[layer]))
        (p,) = predictor.after_layer(it, layer)
        target = (layer + 1) % L
        assert p.target == target and p.distance == 1
        right = router_scores(routers[target], hidden[layer]).mean(dim=0)
        assert torch.allclose(p.scores, right)
        wrong_router = router_scores(routers[layer], hidden[layer]).mean(dim=0)
        wrong_state = router_scores(routers[target], hidden[layer - 1]).mean(dim=0)
        assert not torch.allclose(p.scores, wrong_router) and not torch.allclose(p.scores, wrong_state)


def test_mol_intersection_first_and_fallback_to_the_nearest_layer():
    nearest = torch.tensor([0.9, 0.8, 0.7, 0.1, 0.0, 0.2, 0.3, 0.05])  # top-3: 0, 1, 2
    older = torch.tensor([0.0, 0.9, 0.8, 0.7, 0.1, 0.0, 0.0, 0.0])  # top-3: 1, 2, 3
    scores, common = intersection_scores([nearest, older], k=3)
    assert common == {1, 2}
    ranking = torch.argsort(scores, descending=True, stable=True).tolist()
    assert ranking[:2] == [1, 2] and ranking[2] == 0  # intersection first, then the nearest layer's order
    disjoint = torch.tensor([0.0, 0.0, 0.0, 0.9, 0.8, 0.7, 0.0, 0.0])
    scores, common = intersection_scores([nearest, disjoint], k=3)
    assert common == set()
    assert torch.argsort(scores, descending=True, stable=True).tolist() == \
        torch.argsort(nearest, descending=True, stable=True).tolist()  # empty: speculative's ranking


def test_mol_uses_p_earlier_layers():
    routers = identity_routers()
    mol = MolPredictor(routers, k=3, layers=3)
    it = Iteration(L, N, routers)
    it.begin(torch.zeros(1, H))
    hs = [torch.tensor([[5.0, 4, 3, 0, 0, 0, 0, 0]]), torch.tensor([[0.0, 4, 3, 5, 0, 0, 0, 0]]),
          torch.tensor([[0.0, 0, 3, 5, 4, 0, 0, 0]])]
    for layer, h in enumerate(hs):
        it.observe(layer, h, top_k(h))
        (prediction,) = mol.after_layer(it, layer)
    assert mol.last_intersection == {2}  # {0,1,2} ∩ {1,2,3} ∩ {2,3,4}
    assert prediction.target == 3 and prediction.distance == 1
    assert prediction.ranking()[0] == 2 and prediction.count == 1  # only the intersection is prefetched
    h = torch.tensor([[0.0, 0, 0, 0, 0, 5, 4, 3]])  # disjoint from the earlier top-3 sets
    it.observe(3, h, top_k(h))
    (fallback,) = mol.after_layer(it, 3)
    assert mol.last_intersection == set() and fallback.count is None  # speculative's candidates
    assert fallback.ranking()[:3] == [5, 6, 7]


# --- expert-map (fMoE) -------------------------------------------------------------------
def pattern_passes(patterns, order):
    return [(patterns[p][0], None, patterns[p][1]) for p in order]


def test_expert_map_learns_repeated_patterns_and_is_chance_on_random():
    patterns = pattern_routing(4)
    predictor = ExpertMapPredictor(L, N, K, capacity=50, distance=3, synchronous=True)
    driver = Driver(predictor)
    driver.run(pattern_passes(patterns, [0, 1, 2, 3]))  # each pattern seen once
    driver.fresh_board()
    order = torch.randint(0, 4, (40,), generator=torch.Generator().manual_seed(5)).tolist()
    board = driver.run(pattern_passes(patterns, order))
    # semantic matching (targets 0..d−1) and trajectory matching (targets >= d) are both exact
    assert torch.all(board.accuracy() == 1.0), board.accuracy()
    assert torch.all(board.precision() == 1.0)  # a perfect match (score 1, δ = 0) loads only K
    board = Driver(ExpertMapPredictor(L, N, K, synchronous=True)).run(random_passes(300))
    assert float(board.accuracy().mean()) < 0.45


def test_expert_map_distance_and_semantic_targets():
    patterns = pattern_routing(2)
    predictor = ExpertMapPredictor(L, N, K, distance=3, synchronous=True)
    driver = Driver(predictor)
    driver.run(pattern_passes(patterns, [0, 1]))
    it = driver.it
    it.begin(patterns[0][0])
    semantic = predictor.begin(it)
    assert [(p.target, p.distance) for p in semantic] == [(0, 1), (1, 2), (2, 3)]  # from the embedding
    it.observe(0, None, patterns[0][1][0])
    (trajectory,) = predictor.after_layer(it, 0)
    assert (trajectory.target, trajectory.distance) == (3, 3)  # l + d, issued d ahead
    assert trajectory.priority_weight == pytest.approx(1 / 3)  # p / (l − l_now)


def test_expert_map_worker_never_blocks_a_layer():
    patterns = pattern_routing(2)
    predictor = ExpertMapPredictor(L, N, K, distance=2)
    Driver(predictor).run(pattern_passes(patterns, [0, 1]))
    predictor.drain()
    slow_match = predictor.store.match_trajectory

    def slow(rows):
        time.sleep(0.3)
        return slow_match(rows)

    predictor.store.match_trajectory = slow
    it = Iteration(L, N)
    it.begin(patterns[0][0])
    early = predictor.begin(it)  # the semantic match may or may not be ready here
    predictor.drain()
    it.observe(0, None, patterns[0][1][0])
    start = time.perf_counter()
    first = predictor.after_layer(it, 0)
    assert time.perf_counter() - start < 0.1  # the slow trajectory match runs on the worker
    # what was ready: the semantic match for targets 0..d−1 (0 only if ready before layer 0 routed)
    targets = ({p.target for p in early}, {p.target for p in first})
    assert targets in [(set(), {1}), ({0, 1}, set())]  # never the trajectory match (target 2) yet
    predictor.drain()
    it.observe(1, None, patterns[0][1][1])
    later = predictor.after_layer(it, 1)
    assert 2 in {p.target for p in later}  # layer 0's trajectory match (target 0 + d), now ready
    predictor.close()


def test_prefetch_count_follows_delta():
    row = torch.tensor([0.5, 0.2, 0.1, 0.1, 0.05, 0.05, 0.0, 0.0])
    assert prefetch_count(row, score=1.0, top_k=2) == 2  # δ = 0: K
    assert prefetch_count(row, score=0.2, top_k=2) == 3  # δ = 0.8: 0.5+0.2+0.1 reaches it
    assert prefetch_count(row, score=-1.0, top_k=2) == 6  # δ = clip(2) = 1: the whole mass
    assert prefetch_count(row, score=0.6, top_k=1) == 1  # δ = 0.4 ≤ 0.5 but never fewer than K


def test_map_store_capacity_rdy_replacement_and_entry_size():
    d = 2  # d/L ≠ (L−d)/L, so swapped weights would show
    store = MapStore(capacity=5, num_layers=L, num_experts=N, distance=d)
    g = torch.Generator().manual_seed(0)
    maps = [torch.rand(L, N, generator=g) for _ in range(12)]
    sems = [torch.randn(H, generator=g) for _ in range(12)]
    for m, s in zip(maps[:5], sems[:5]):
        store.add(m, s)
    for m, s in zip(maps[5:], sems[5:]):
        before = store.maps[: store.count].clone(), store.semantic[: store.count].clone()
        # RDY = (d/L)·cos(semantic) + ((L−d)/L)·cos(map), computed independently
        rdy = [(d / L) * torch.nn.functional.cosine_similarity(bs, s, dim=0)
               + ((L - d) / L) * torch.nn.functional.cosine_similarity(bm.flatten(), m.flatten(), dim=0)
               for bm, bs in zip(*before)]
        expected = int(torch.argmax(torch.stack(rdy)))
        slot = store.add(m, s)
        assert store.count == 5 and slot == expected
        assert torch.equal(store.maps[slot], m)
    # a near-duplicate of a stored map replaces exactly that one
    target = 2
    slot = store.add(store.maps[target] + 1e-3, store.semantic[target].clone())
    assert slot == target
    # the weights: same meaning but another trajectory (A) vs another meaning, same trajectory (B)
    two = MapStore(capacity=2, num_layers=L, num_experts=N, distance=d)
    first_half, second_half = torch.zeros(L, N), torch.zeros(L, N)
    first_half[:, : N // 2], second_half[:, N // 2:] = 1.0, 1.0
    meaning, other = torch.zeros(H), torch.zeros(H)
    meaning[0], other[1] = 1.0, 1.0
    two.add(first_half, meaning)  # A: RDY = (d/L)·1 + ((L−d)/L)·0 = 1/3
    two.add(second_half, other)  # B: RDY = (d/L)·0 + ((L−d)/L)·1 = 2/3
    assert two.add(second_half.clone(), meaning.clone()) == 1
    assert store.entry_bytes(H) == 4 * (L * N + H)
    assert store.entry_bytes(H) == store.maps[0].nbytes + store.semantic[0].nbytes


# --- eam (MoE-Infinity) -------------------------------------------------------------------
def request_passes(pattern, decode_steps: int = 5, prompt_tokens: int = 4):
    embedding, layers = pattern
    prefill = (embedding.repeat(prompt_tokens, 1), None, [r.repeat(prompt_tokens, 1) for r in layers])
    return [prefill] + [(embedding, None, layers)] * decode_steps


def test_eam_learns_repeated_requests_and_is_chance_on_random():
    patterns = pattern_routing(4, seed=7)
    predictor = EamPredictor(L, N, K, capacity=10)
    driver = Driver(predictor)
    for p in range(4):
        driver.run(request_passes(patterns[p]))
    driver.fresh_board()
    for p in [2, 0, 3, 1, 1, 2]:
        driver.run(request_passes(patterns[p]))
    assert torch.all(driver.board.accuracy() == 1.0), driver.board.accuracy()
    random_driver = Driver(EamPredictor(L, N, K))
    g = torch.Generator().manual_seed(3)
    for _ in range(30):  # requests of random routing: prefill + decode
        random_driver.run(random_passes(6, seed=int(torch.randint(0, 10**6, (1,), generator=g))))
    assert float(random_driver.board.accuracy().mean()) < 0.45


def test_eam_multi_layer_predictions_use_the_proximity_weight():
    patterns = pattern_routing(2, seed=9)
    predictor = EamPredictor(L, N, K)
    driver = Driver(predictor)
    driver.run(request_passes(patterns[0]) + request_passes(patterns[1]))
    it = driver.it
    it.begin(patterns[0][0].repeat(3, 1))  # a new request
    predictor.begin(it)
    it.observe(0, None, patterns[0][1][0].repeat(3, 1))
    predictions = predictor.after_layer(it, 0)
    assert [p.distance for p in predictions] == list(range(1, L))
    for p in predictions:
        assert p.weight == pytest.approx(1 - p.distance / L)  # 1 − (i − l)/L
        assert p.count == K
    assert set(predictions[0].ranking()[:K]) == set(patterns[0][1][1][0].tolist())  # the matched request's layer 1


def test_eam_collection_capacity_most_similar_replacement_and_entry_size():
    collection = EamCollection(capacity=4, num_layers=L, num_experts=N)
    g = torch.Generator().manual_seed(1)
    for _ in range(4):
        collection.add(torch.randint(0, 5, (L, N), generator=g).float())
    for _ in range(10):
        new = torch.randint(0, 5, (L, N), generator=g).float()
        stored = collection.stored().clone()
        sims = [torch.nn.functional.cosine_similarity(normalise_rows(s).flatten(), normalise_rows(new).flatten(), dim=0)
                for s in stored]
        slot = collection.add(new)
        assert collection.count == 4
        assert slot == int(torch.argmax(torch.stack(sims)))
    assert collection.entry_bytes == 4 * L * N == collection.matrices[0].nbytes


def test_iteration_keeps_only_recent_router_inputs():
    it = Iteration(L, N, keep_hidden=3)
    it.begin(torch.zeros(1, H))
    for layer in range(L):
        it.observe(layer, torch.zeros(1, N), torch.zeros(1, K, dtype=torch.long))
    assert sorted(it.hidden) == [L - 3, L - 2, L - 1] and it.observed == list(range(L))


def test_iteration_requests():
    it = Iteration(L, N)
    it.begin(torch.zeros(5, H))
    assert (it.request, it.index, it.tokens) == (0, 0, 5)
    it.begin(torch.zeros(1, H))
    it.begin(torch.zeros(1, H))
    assert (it.request, it.index) == (0, 2)
    it.begin(torch.zeros(3, H))  # the next prompt / chat turn
    assert (it.request, it.index) == (1, 0)


# --- auto -------------------------------------------------------------------------------------
class Oracle(BasePredictor):
    """Right about the layers in `good`, wrong about the others (it reads the schedule)."""

    def __init__(self, name, schedule, good) -> None:
        self.name, self.schedule, self.good = name, schedule, good
        self.step = -1

    def begin(self, it):
        self.step += 1
        return []

    def after_layer(self, it, layer):
        target = layer + 1
        if target >= L:
            return []
        truth = set(self.schedule[self.step][target].reshape(-1).tolist())
        chosen = truth if target in self.good else set(range(N)) - truth
        scores = torch.tensor([1.0 if e in chosen else 0.0 for e in range(N)])
        return [Prediction(target, scores, distance=1)]


def test_auto_chooses_per_layer_the_most_accurate_at_replan():
    passes = random_passes(40, seed=4)
    schedule = [routed for _, _, routed in passes]
    even = Oracle("even", schedule, good={2, 4})
    odd = Oracle("odd", schedule, good={1, 3, 5})
    auto = AutoPredictor([even, odd], L, K, min_steps=8)
    driver = Driver(auto)
    driver.run(passes[:20])
    assert auto.chosen() == ["even"] * L  # before any plan: the first candidate
    assert driver.board.accuracy()[1] == 0.0  # only the chosen candidate's predictions got through
    auto.replan()
    assert auto.chosen() == ["even", "odd", "even", "odd", "even", "odd"]  # layer 0: a tie, kept
    driver.fresh_board()
    driver.run(passes[20:])
    assert torch.all(driver.board.accuracy()[1:] == 1.0)


# --- fMoE's eviction policy ---------------------------------------------------------------------
def test_fmoe_policy_keeps_highest_p_times_freq():
    policy = make_policy("finemoe", 4)
    assert isinstance(policy, FinemoePolicy) and policy.uses_prediction
    for e, n in [(0, 5), (1, 2), (2, 1)]:
        for step in range(n):
            policy.touch(e, step)
    assert policy.ranking(10) == [0, 1, 2, 3]  # uniform p: by frequency (LFU)
    policy.see_prediction([0.1, 0.2, 3.0, -1.0])  # normalised, negatives as 0
    assert sum(policy.p) == pytest.approx(1.0) and policy.p[3] == 0.0
    # p·freq: 0.1·5/3.3, 0.2·2/3.3, 3·1/3.3 → expert 2 first, expert 3 (p = 0) last
    assert policy.ranking(10) == [2, 0, 1, 3]
    assert policy.choose_victim([0, 1, 2], 10) == 1  # the highest 1/(p·freq)


# --- the prefetcher in the engine ------------------------------------------------------------------
@pytest.fixture(scope="module")
def mixtral(checkpoints):
    return load_model(str(checkpoints["mixtral"]), device="cpu", dtype="float32")


def one_hot_scores(experts, value=1.0):
    scores = torch.zeros(N)
    scores[list(experts)] = value
    return scores


def test_prefetcher_orders_by_distance_and_never_displaces_busy_entries(mixtral):
    lm = mixtral
    shape = lm.shape
    clock = VirtualClock()
    engine = Engine(lm.layers, lm.store, shape, EmulatedLink(1.0, clock=clock), lm.device, lm.dtype)
    engine.configure(make_settings("prefetch-only", shape, 2 * shape.top_k * shape.expert_bytes))
    pool = engine.pool
    assert len(pool.entries) == 4
    near = Prediction(1, one_hot_scores([0, 1], 0.5), distance=1)
    far = Prediction(3, one_hot_scores([2, 3], 0.5), distance=3)
    rankings = engine.prefetcher.issue([far, near])
    assert rankings[1][:2] == [0, 1] and rankings[3][:2] == [2, 3]  # returned, not written into the engine
    staged = {(e.layer, e.expert): e for e in pool.entries}
    assert set(staged) == {(1, 0), (1, 1), (3, 2), (3, 3)}
    assert max(staged[(1, e)].transfer.priority for e in (0, 1)) < min(staged[(3, e)].transfer.priority for e in (2, 3))
    assert min(e.transfer.priority for e in pool.entries) == PREFETCH
    engine.link.reprioritise(staged[(3, 2)].transfer, 0)  # next on the link ...
    clock.advance(engine.link.duration(shape.expert_bytes) * 1.5)
    assert staged[(1, 0)].transfer.ready() and staged[(3, 2)].transfer.state is TransferState.RUNNING  # ... in flight
    staged[(1, 0)].in_use = True  # in use
    urgent = Prediction(2, one_hot_scores([4, 5, 6], 0.9), distance=1, count=3)
    engine.prefetcher.issue([urgent])
    now = {(e.layer, e.expert) for e in pool.entries if e is not None}
    # only the queued, idle, lower-priority entries gave way; the pool stays at its size
    assert now == {(1, 0), (3, 2), (2, 4), (2, 5)}
    too_far = Prediction(1, one_hot_scores([7]), distance=shape.num_layers)
    engine.prefetcher.issue([too_far])
    assert pool.find(1, 7) is None  # a layer that routes again first: ignored
    engine.close()


# --- exactness: every predictor gives transformers' tokens ----------------------------------------
PROMPT = torch.tensor([[5, 17, 42, 99, 7, 3, 250, 11, 64, 128]])
NEW_TOKENS = 16


@pytest.fixture(scope="module", params=["mixtral", "qwen2_moe", "deepseek_v3"])
def family(request, checkpoints):
    path = checkpoints[request.param]
    reference = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    reference.generation_config.eos_token_id = None
    want = reference.generate(PROMPT, max_new_tokens=NEW_TOKENS, do_sample=False)[0, PROMPT.shape[1]:].tolist()
    return load_model(str(path), device="cpu", dtype="float32"), want


@pytest.mark.parametrize("name", list(PREDICTORS))
def test_every_predictor_keeps_the_tokens_of_transformers(family, name):
    lm, want = family
    shape = lm.shape
    predictor = make_predictor(name, lm.layers, shape.num_experts, shape.top_k)
    link = EmulatedLink(gbps=20, clock=VirtualClock(), copy=True)  # asynchronous, deterministic
    engine = Engine(lm.layers, lm.store, shape, link, lm.device, lm.dtype, predictor=predictor)
    engine.install(lm.model)
    tight = 2 * shape.top_k * shape.expert_bytes + shape.expert_bytes
    try:
        for eviction in ("lcp", "finemoe"):
            engine.configure(make_settings("uniform", shape, tight, eviction=eviction))
            for _ in range(2):  # the second request finds the first one's maps / EAM
                got = [e.token_id for e in stream_generate(lm.model, PROMPT, engine=engine,
                                                           max_new_tokens=NEW_TOKENS, stop_on_eos=False)]
                assert got == want, f"{name} ({eviction}): tokens differ"
                assert engine.device_bytes() <= tight  # prefetches live in the plan's staging pool only
        assert engine.counters().prefetch_issued > 0
    finally:
        engine.close()


def test_bench_refuses_an_unknown_predictor_in_one_line(checkpoints):
    from typer.testing import CliRunner

    from fmoe_cli.cli import app

    result = CliRunner().invoke(app, ["bench", str(checkpoints["mixtral"]), "--predictor", "oracle"])
    assert result.exit_code == 2
    assert "error: unknown predictor 'oracle'" in result.output and "Traceback" not in result.output


def test_bench_runs_with_a_predictor_and_names_it(checkpoints):
    import json

    from typer.testing import CliRunner

    from fmoe_cli.cli import app

    result = CliRunner().invoke(app, ["bench", str(checkpoints["mixtral"]), "--policy", "uniform", "--predictor",
                                      "expert-map", "--tokens", "4", "--warmup", "1", "--device", "cpu",
                                      "--emulate-link", "20", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["predictor"] == "expert-map" and report["runs"][0]["prefetch_precision"] >= 0


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_the_predictor_sees_this_iterations_router_input(checkpoints, family):
    """Issue 20 §8: tokens cannot show a stale prediction input (only the prefetch gets worse). A spy on
    the speculative predictor checks every `device_part` call against the router input this very
    forward gave the same layer, for the prefill and every decode step."""
    lm = load_model(str(checkpoints[family]), device="cpu", dtype="float32")
    routers = [layer.router for layer in lm.layers]
    router_input = {}
    hooks = [r.register_forward_pre_hook(lambda m, args, i=i: router_input.__setitem__(i, args[0].detach().clone()))
             for i, r in enumerate(routers)]
    seen = []

    class Spy(SpeculativePredictor):
        def device_part(self, it, layer, hidden):
            want = router_input[layer].reshape(-1, hidden.shape[-1])
            seen.append((layer, hidden.shape[0], torch.equal(hidden, want)))
            return super().device_part(it, layer, hidden)

    engine = Engine(lm.layers, lm.store, lm.shape, EmulatedLink(20, clock=VirtualClock(), copy=True), lm.device,
                    lm.dtype, predictor=Spy(routers))
    engine.install(lm.model)
    engine.configure(make_settings("prefetch-only", lm.shape, 2 * lm.shape.top_k * lm.shape.expert_bytes))
    list(stream_generate(lm.model, PROMPT, engine=engine, max_new_tokens=4, stop_on_eos=False))
    engine.close()
    for h in hooks:
        h.remove()
    layers = lm.shape.num_layers
    assert [layer for layer, *_ in seen] == list(range(layers)) * 4
    assert [tokens for _, tokens, _ in seen] == [PROMPT.shape[1]] * layers + [1] * 3 * layers
    assert all(same for *_, same in seen)


def test_a_slow_expert_map_worker_keeps_a_bounded_backlog():
    """Issue 20 §7: with the worker far slower than the tokens (here: stuck until released), 200 passes
    leave a bounded queue: stale matches are cancelled, store updates beyond the newest few dropped.
    Then the predictor still predicts from what it stored."""
    import threading

    from fmoe_cli.prediction.expert_map import STORE_BACKLOG

    patterns = pattern_routing(2)
    predictor = ExpertMapPredictor(L, N, K, distance=2)
    gate = threading.Event()
    match = predictor.store.match_trajectory
    predictor.store.match_trajectory = lambda rows: gate.wait(120) and match(rows)
    driver = Driver(predictor)
    backlog = []
    for p in pattern_passes(patterns, [0, 1] * 100):
        driver.run([p])
        backlog.append(len(predictor._pending))
    assert max(backlog) <= 2 + 2 + STORE_BACKLOG, max(backlog)  # d matches, the semantic one, one running
    gate.set()
    predictor.drain()
    assert 1 <= predictor.store.count <= 4 * STORE_BACKLOG  # of 200 updates: the older ones were dropped
    predictor.close()


@pytest.mark.parametrize("family", ["deepseek_v3", "glm4_moe", "mixtral", "qwen3_moe"])
def test_the_router_s_scores_rank_the_experts_it_routes_to_first(family):
    """router_scores' K best are the K experts the router itself chooses for the same hidden states, with distinct
    routers and a nonzero correction bias: DeepSeek-V3 and GLM-4.5 choose within their topk_group best groups
    (2 of 4 groups here), which a ranking by score alone missed."""
    import transformers

    from fmoe_cli.models.demo import tiny_config
    from fmoe_cli.models.families import find_moe_layers
    from fmoe_cli.prediction.base import router_scores

    grouped = {"n_group": 4, "topk_group": 2} if family in ("deepseek_v3", "glm4_moe") else {}
    torch.manual_seed(3)
    config = tiny_config(family, vocab_size=64, **grouped)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    hidden = torch.randn(64, config.hidden_size)
    for layer in find_moe_layers(model):
        with torch.no_grad():
            layer.router.weight.normal_(0, 0.5)
            bias = getattr(layer.router, "e_score_correction_bias", None)
            if bias is not None:
                bias.normal_(0, 0.1)
            routed = layer.router(hidden)[-1]  # [T, K] the experts it routes to
        k = routed.shape[-1]
        predicted = router_scores(layer.router, hidden).topk(k, dim=-1).indices
        assert torch.equal(predicted.sort(dim=-1).values, routed.sort(dim=-1).values), layer.name




@pytest.mark.parametrize("family", families_survey.SERVED_EXACTLY)  # (gemma4: its text model)
def test_the_predictor_ranks_first_the_experts_each_family_s_router_chooses(family):
    """For every family served exactly, its routers' choice-only biases, scales and group limits moved off their init
    (benchmarks/router_choice.py's tiny model, σ = 0.3): the speculative predictor's K best experts for a hidden state h
    at MoE layer L (what it prefetches, issued from layer L − 1) are the K experts layer L's own router chooses for h
    (called by the family's code, as the model calls it), token by token. Before 29 Nov the predictor ranked by the
    router's matrix (and a correction bias on the router itself): AFMoE, AXK2, group-limited DeepSeek-V2, ERNIE-4.5,
    Gemma 4, HY-V3, Kolibri1, Laguna, LFM2-MoE and MiniMax-M2 ranked otherwise; the others are the regression."""
    from test_benchmark_scripts import benchmark  # tests/

    router_choice = benchmark("router_choice")
    model, layers = router_choice.perturbed_model(family, std=0.3, seed=5)
    hidden = torch.randn(48, layers[0].router.weight.shape[-1], generator=torch.Generator().manual_seed(2)) * 2
    num_experts = layers[0].experts.gate_up_proj.shape[0]
    predictor = make_predictor("speculative", layers, num_experts, 2)
    it = Iteration(len(layers), num_experts)
    routed = router_choice.routed(model, layers, torch.randint(5, 300, (1, len(hidden))), hidden)
    for layer, (_, _, chosen) in zip(layers, routed):
        k = chosen.shape[-1]
        issuing = (layer.index - 1) % len(layers)
        predicted = torch.stack([predictor.device_part(it, issuing, row[None])[("speculative", issuing)].topk(k).indices
                                 for row in hidden])
        wrong = (predicted.sort(dim=-1).values != chosen.sort(dim=-1).values).any(dim=-1)
        assert not wrong.any(), f"{family} {layer.name}: {int(wrong.sum())} of {len(hidden)} tokens ranked otherwise"


def test_a_router_without_a_form_keeps_its_scores():
    """Mixtral's router (no ROUTER_FORMS entry, no bias): the scores the predictors rank with are softmax(W·h), as
    before 29 Nov (the expert-map's distributions read their values, not only their order)."""
    import torch.nn.functional as F

    from fmoe_cli.models.demo import tiny_config
    from fmoe_cli.models.families import find_moe_layers
    from fmoe_cli.prediction.base import router_scores

    torch.manual_seed(4)
    model = transformers.AutoModelForCausalLM.from_config(tiny_config("mixtral", vocab_size=64), dtype=torch.float32)
    hidden = torch.randn(5, model.config.hidden_size)
    for layer in find_moe_layers(model):
        assert layer.choice.bias is None and layer.choice.input_scale is None and not layer.choice.groups
        assert torch.allclose(router_scores(layer.choice, hidden), F.linear(hidden, layer.router.weight).softmax(-1))
