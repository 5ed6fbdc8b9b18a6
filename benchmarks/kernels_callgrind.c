/* One a3b expert (H 2048, I 768, chunk 64) through fmoe_segment_forward in a loop, no Python: instruction counts
   per weight under valgrind (steady on a loaded machine, unlike times), and CPU time per call
   (docs/bench.md § CPU expert kernels). Random codes, float16 scales of a plausible size.

     gcc -O3 -mavx2 -mfma -mf16c -pthread -o /tmp/kc benchmarks/kernels_callgrind.c -lm   (valgrind knows no AVX-512)
     valgrind --tool=callgrind --toggle-collect=run_calls /tmp/kc FMT 1 1 2     # I refs / weights = instructions/weight
     gcc -O3 -march=native -pthread -o /tmp/kn benchmarks/kernels_callgrind.c -lm && /tmp/kn FMT 1 2 200 150

   Arguments: FMT (0 f32, 1 bf16, 2 int8, 3 int4), T tokens, threads, calls, [copies of the expert rotated through
   (150: beyond a 300 MB cache), [q8: 1 = --activations int8]]. -DFMOE_PHASES=1: gate and up only. */
#include "../fmoe_cli/kernels/experts.c"
#include <stdio.h>
#include <time.h>

static uint64_t state = 88172645463325252ull;
static uint32_t rnd(void) { state ^= state << 13; state ^= state >> 7; state ^= state << 17; return (uint32_t)state; }
static float small(void) { return ((int)(rnd() % 2001) - 1000) * 2e-5f; }

__attribute__((noinline)) void run_calls(int calls, int64_t copies, int fmt, const uint8_t *rows, int64_t bytes,
                                         int64_t I, int64_t H, int64_t pb, int64_t G, const float *x, int64_t tokens,
                                         float *acc, int threads, int q8) {
    for (int k = 0; k < calls; k++)
        fmoe_segment_forward(fmt, rows + (k % copies) * bytes, I, H, pb, fmt >= 2 ? G : 0, 0, 64, x, 0, tokens, acc, 0,
                             NULL, threads, q8);
}

int main(int argc, char **argv) {
    if (argc < 5) { fprintf(stderr, "usage: %s FMT T THREADS CALLS [COPIES [Q8]]\n", argv[0]); return 2; }
    int fmt = atoi(argv[1]), threads = atoi(argv[3]), calls = atoi(argv[4]), q8 = argc > 6 ? atoi(argv[6]) : 0;
    int64_t tokens = atoi(argv[2]), copies = argc > 5 ? atoi(argv[5]) : 1, H = 2048, I = 768, G = fmt == 2 ? 128 : 64;
    int64_t pb = fmt == 0 ? 4 * H : fmt == 1 ? 2 * H : fmt == 2 ? H + 2 * H / G : H / 2 + 4 * H / G, bytes = I * 3 * pb;
    uint8_t *rows = aligned_alloc(64, bytes * copies);
    for (int64_t r = 0; r < I * 3 * copies; r++) {
        uint8_t *row = rows + r * pb;
        uint16_t *meta = (uint16_t *)(row + (fmt == 2 ? H : H / 2));
        if (fmt == 0)
            for (int64_t j = 0; j < H; j++) ((float *)row)[j] = small();
        else if (fmt == 1)
            for (int64_t j = 0; j < H; j++) ((uint16_t *)row)[j] = float_to_bf16(small());
        else
            for (int64_t j = 0; j < (fmt == 2 ? H : H / 2); j++) row[j] = rnd();
        if (fmt == 2)
            for (int64_t g = 0; g < H / G; g++) meta[g] = 0x1c00 + rnd() % 256; /* ≈ 0.004 */
        if (fmt == 3)
            for (int64_t g = 0; g < H / G; g++) meta[2 * g] = 0x1c00 + rnd() % 256, meta[2 * g + 1] = 0x9c00 + rnd() % 256;
    }
    float *x = malloc(sizeof(float) * H * tokens), *acc = malloc(sizeof(float) * H * tokens);
    for (int64_t j = 0; j < H * tokens; j++) x[j] = small() * 50;
    struct timespec w0, w1, c0, c1;
    clock_gettime(CLOCK_MONOTONIC, &w0), clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &c0);
    run_calls(calls, copies, fmt, rows, bytes, I, H, pb, G, x, tokens, acc, threads, q8);
    clock_gettime(CLOCK_MONOTONIC, &w1), clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &c1);
    double wall = (w1.tv_sec - w0.tv_sec) * 1e6 + (w1.tv_nsec - w0.tv_nsec) / 1e3;
    double cpu = (c1.tv_sec - c0.tv_sec) * 1e6 + (c1.tv_nsec - c0.tv_nsec) / 1e3;
    printf("format %d, %ld token(s), %d thread(s), %d calls of %ld weights: %.1f us wall, %.1f us CPU a call "
           "(checksum %g)\n", fmt, (long)tokens, threads, calls, (long)(3 * H * I), wall / calls, cpu / calls,
           acc[0] + acc[H - 1]);
    return 0;
}
