"""Issue 37 §1: a resident decode step replayed from one CUDA graph (generate.DecodeGraph). This machine has no GPU:
the graph is a stand-in that runs the captured step eagerly on each replay and then forgets what the engine's Python
did in it (a real replay runs no Python), so what is checked is DecodeGraph's own logic — the static KV cache and its
positions, capture after warm-up steps, the engine told which layers' routing the replay copied — and the eager
fallback when capture fails. Whether CUDA captures the step only a GPU can say (benchmarks/gpu_check.py)."""

from __future__ import annotations

import pytest
import torch
import transformers

from fmoe_cli import kernels
from fmoe_cli.generate import DecodeGraph, stream_generate
from fmoe_cli.models.load import load_model
from fmoe_cli.offload.engine import Engine
from fmoe_cli.offload.link import EmulatedLink
from fmoe_cli.planning.presets import make_settings

PROMPT = torch.tensor([[5, 17, 42, 99, 7, 3, 250, 11, 64, 128]])
NEW_TOKENS = 12


class EagerGraph:
    """A CUDA graph's stand-in: capture runs the step eagerly; replay runs it again into the captured logits and
    drops the engine's own deferrals (DecodeGraph then defers every layer, as after a real replay)."""

    replays = 0

    def __init__(self, decode: DecodeGraph) -> None:
        self.decode = decode

    def capture(self):
        import contextlib

        return contextlib.nullcontext()

    def replay(self) -> None:
        decode = self.decode
        decode.logits.copy_(decode._forward(decode.ids, decode.position))
        decode.engine.discard_deferred()
        EagerGraph.replays += 1


class FailingGraph(EagerGraph):
    def capture(self):
        raise RuntimeError("operation not permitted when stream is capturing")


def device_path_engine(path, graph_factory, monkeypatch, veto=None):
    """The model at `path` and an engine on the device's path (torch's matmuls, device_side) over an instant emulated
    link, DecodeGraph's graphs made by `graph_factory` (None: none, as on the CPU)."""
    monkeypatch.setattr(kernels, "library", lambda: None)  # torch's matmuls: the device's path
    lm = load_model(str(path), device="cpu", dtype="float32")
    if hasattr(lm.model, "decode_token"):
        lm.model.decode_token.enabled = False
    engine = Engine(lm.layers, lm.store, lm.shape, EmulatedLink(None), lm.device, lm.dtype)
    engine.device_side = True
    engine.graph_factory = graph_factory
    engine.graph_veto = veto
    engine.install(lm.model)
    return lm, engine


def generate(path, graph_factory, monkeypatch, family_tokens=NEW_TOKENS, policy="resident", veto=None):
    lm, engine = device_path_engine(path, graph_factory, monkeypatch, veto)
    shape = lm.shape
    engine.configure(make_settings(policy, shape, shape.all_experts_bytes // 2 + 2 * shape.top_k * shape.expert_bytes))
    runs, counted = [], []
    for _ in range(2):  # the second generation replays the first one's graph
        before = engine.counters()
        runs.append([e.token_id for e in stream_generate(lm.model, PROMPT, engine=engine,
                                                         max_new_tokens=family_tokens, stop_on_eos=False)])
        counted.append(engine.counters() - before)
    graphs = dict(engine.decode_graphs)
    engine.close()
    assert runs[0] == runs[1] and counted[0].activations == counted[1].activations
    if policy == "resident":  # every layer's routing bookkept (all whole); the host waited only in the prefill
        assert counted[0].hits_full == counted[0].activations > 0 and counted[0].host_waits == shape.num_layers
    return runs[0], graphs, counted[0]


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_replayed_decode_steps_give_the_eager_tokens(checkpoints, family, monkeypatch):
    path = checkpoints[family]
    reference = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    reference.generation_config.eos_token_id = None
    want = reference.generate(PROMPT, max_new_tokens=NEW_TOKENS, do_sample=False)[0, PROMPT.shape[1]:].tolist()
    eager, none, eager_counted = generate(path, None, monkeypatch)  # no factory on the CPU: the eager step
    assert not none and eager == want
    EagerGraph.replays = 0
    replayed, graphs, counted = generate(path, EagerGraph, monkeypatch)
    assert replayed == want and counted.activations == eager_counted.activations
    assert len(graphs) == 1 and EagerGraph.replays == 2 * (NEW_TOKENS - 1)  # one graph, every decode step replayed


def test_a_capture_that_fails_runs_the_step_eagerly_with_one_line(checkpoints, monkeypatch, capsys):
    path = checkpoints["qwen3_moe"]
    eager, _, _ = generate(path, None, monkeypatch)
    got, graphs, _ = generate(path, FailingGraph, monkeypatch)
    assert got == eager
    assert all(graph.eager for graph in graphs.values())
    err = capsys.readouterr().err
    assert err.count("CUDA graphs: the decode step could not be captured") == 1


def test_a_plan_that_cannot_be_replayed_decodes_eagerly_on_the_same_static_cache(checkpoints, monkeypatch):
    """On a GPU every plan decodes through the StaticCache (the same attention as the graphed `resident`): `lru` reads
    its routing on the host, so its steps run eagerly there, and give the graphed resident run's tokens."""
    path = checkpoints["qwen3_moe"]
    EagerGraph.replays = 0
    resident, _, _ = generate(path, EagerGraph, monkeypatch)
    replays = EagerGraph.replays
    lru, graphs, counted = generate(path, EagerGraph, monkeypatch, policy="lru")
    assert lru == resident and EagerGraph.replays == replays  # no replay: eager steps
    assert len(graphs) == 1 and all(g.eager and g.graph is None and g.length > 0 for g in graphs.values())
    assert counted.misses > 0  # it really loaded


def test_a_veto_keeps_a_resident_plan_eager(checkpoints, monkeypatch):
    """`Engine.graph_veto` (fmoe bench --replay-routing: a routing Python picks token by token, which a graph would
    freeze at the capture's token): the resident plan's steps run eagerly on the static cache, none replayed."""
    path = checkpoints["qwen3_moe"]
    EagerGraph.replays = 0
    replayed, _, _ = generate(path, EagerGraph, monkeypatch)
    assert EagerGraph.replays > 0
    EagerGraph.replays = 0
    vetoed, graphs, _ = generate(path, EagerGraph, monkeypatch, veto="routing replayed")
    assert vetoed == replayed and EagerGraph.replays == 0 and all(g.eager for g in graphs.values())


class CountingGraph(EagerGraph):
    captures = 0

    def capture(self):
        CountingGraph.captures += 1
        return super().capture()


def chat_turns(path, graph_factory, monkeypatch, replan_between: bool = False):
    """Two turns of a chat session (chat and serve answer through ChatSession.generate) on a resident plan, on the
    device's path; with a graph factory the conversation's KV cache is the engine's DecodeGraph (its StaticCache),
    as on a GPU. `replan_between`: the engine configured again between the turns, as an idle re-plan does."""
    from fmoe_cli.chat.session import ChatSession

    lm, engine = device_path_engine(path, graph_factory, monkeypatch)
    settings = make_settings("resident", lm.shape, lm.shape.all_experts_bytes)
    engine.configure(settings)
    session = ChatSession(lm, engine, max_new_tokens=8, context=300)
    answers, reused, graphs = [], [], []
    prompts = ([5, 17, 42, 99, 7, 3], [11, 64, 128, 9])
    conversation: list[int] = []
    for turn, prompt in enumerate(prompts):
        if turn and replan_between:
            engine.configure(settings, warm=True)
        conversation = conversation + prompt
        events = list(session.generate(conversation, 8, session.sampling))
        answers.append([e.token_id for e in events])
        reused.append(session.reused)
        graphs.append(session._kv)
        conversation = conversation + answers[-1][:-3]  # the next turn shares less than the cache holds: a crop
    engine.close()
    return answers, reused, graphs


def test_a_conversation_continues_on_the_static_cache_and_replays_its_steps(checkpoints, monkeypatch):
    """Chat and serve on a GPU: the conversation's KV cache is the engine's DecodeGraph, kept between answers, cropped
    to the shared prefix and extended by the new turn, its decode steps replayed from one graph captured once (or, after
    a re-plan, once more: the graph reads the old plan's buffers, the cache is the conversation's) — the tokens of
    the CPU's growing cache, turn for turn."""
    path = checkpoints["qwen3_moe"]
    want, want_reused, caches = chat_turns(path, None, monkeypatch)
    assert not isinstance(caches[0], DecodeGraph) and want_reused[1] == 6 + len(want[0]) - 3
    for replan, captures in ((False, 1), (True, 2)):
        CountingGraph.captures = EagerGraph.replays = 0
        got, reused, graphs = chat_turns(path, CountingGraph, monkeypatch, replan_between=replan)
        assert got == want and reused == want_reused  # the second turn pre-filled only what the first had not
        assert isinstance(graphs[0], DecodeGraph) and graphs[1] is graphs[0]
        assert CountingGraph.captures == captures and EagerGraph.replays == 2 * (len(want[0]) - 1)
        assert graphs[1].length == 6 + len(got[0]) - 3 + 4 + len(got[1]) - 1  # prompt, answer, prompt, answer
