/* Time ggml's KDA op (ggml_gated_delta_net with a gate per key channel) on the CPU backend.
 *
 * Usage: ggml_kda B H T D THREADS REPEATS INPUT OUTPUT
 *
 * INPUT holds float32 arrays, C order, one after another, in ggml's layout (time-major, as kda's):
 *   q, k, v, g : [B, T, H, D]      beta : [B, T, H]      state : [B, H, D, D] (S transposed: [v][k])
 * OUTPUT receives the output [B, T, H, D] followed by the final state [B, H, D, D] (transposed),
 * from the last repeat. Prints one line per repeat: "time_s <seconds>" (graph compute only).
 * As llama.cpp runs a model: one persistent threadpool of THREADS threads and one compute plan (its work
 * buffer allocated once), made before the repeats; each repeat times ggml_graph_compute alone, so no
 * thread is created or joined inside the timer.
 * ggml scales by 1/sqrt(D) (fixed), with K == V == D.
 */
#define _POSIX_C_SOURCE 199309L
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "ggml.h"
#include "ggml-cpu.h"

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + 1e-9 * ts.tv_nsec;
}

static int read_into(FILE *f, struct ggml_tensor *t) {
    size_t n = ggml_nbytes(t);
    return fread(t->data, 1, n, f) == n ? 0 : -1;
}

int main(int argc, char **argv) {
    if (argc != 9) {
        fprintf(stderr, "usage: %s B H T D THREADS REPEATS INPUT OUTPUT\n", argv[0]);
        return 2;
    }
    const int64_t B = atoll(argv[1]), H = atoll(argv[2]), T = atoll(argv[3]), D = atoll(argv[4]);
    const int threads = atoi(argv[5]), repeats = atoi(argv[6]);
    const size_t io = (size_t)B * T * H * D * 4 * sizeof(float) * 2 + (size_t)B * H * D * D * 8 * sizeof(float);
    struct ggml_init_params params = {io + (size_t)256 * 1024 * 1024, NULL, false};
    struct ggml_context *ctx = ggml_init(params);
    if (!ctx) {
        fprintf(stderr, "ggml_init failed\n");
        return 1;
    }
    struct ggml_tensor *q = ggml_new_tensor_4d(ctx, GGML_TYPE_F32, D, H, T, B);
    struct ggml_tensor *k = ggml_new_tensor_4d(ctx, GGML_TYPE_F32, D, H, T, B);
    struct ggml_tensor *v = ggml_new_tensor_4d(ctx, GGML_TYPE_F32, D, H, T, B);
    struct ggml_tensor *g = ggml_new_tensor_4d(ctx, GGML_TYPE_F32, D, H, T, B);
    struct ggml_tensor *beta = ggml_new_tensor_4d(ctx, GGML_TYPE_F32, 1, H, T, B);
    struct ggml_tensor *s0 = ggml_new_tensor_4d(ctx, GGML_TYPE_F32, D, D, H, B);
    FILE *f = fopen(argv[7], "rb");
    if (!f || read_into(f, q) || read_into(f, k) || read_into(f, v) || read_into(f, g) || read_into(f, beta) ||
        read_into(f, s0)) {
        fprintf(stderr, "cannot read %s\n", argv[7]);
        return 1;
    }
    fclose(f);
    struct ggml_tensor *out = ggml_gated_delta_net(ctx, q, k, v, g, beta, s0, 1);
    struct ggml_cgraph *graph = ggml_new_graph(ctx);
    ggml_build_forward_expand(graph, out);
    struct ggml_threadpool_params tpp = ggml_threadpool_params_default(threads);
    struct ggml_threadpool *pool = ggml_threadpool_new(&tpp);
    if (!pool) {
        fprintf(stderr, "ggml_threadpool_new failed\n");
        return 1;
    }
    struct ggml_cplan plan = ggml_graph_plan(graph, threads, pool);
    uint8_t *work = plan.work_size ? malloc(plan.work_size) : NULL;
    if (plan.work_size && !work) {
        fprintf(stderr, "cannot allocate %zu bytes of work data\n", plan.work_size);
        return 1;
    }
    plan.work_data = work;
    for (int r = 0; r < repeats; r++) {
        double t0 = now();
        if (ggml_graph_compute(graph, &plan) != GGML_STATUS_SUCCESS) {
            fprintf(stderr, "graph compute failed\n");
            return 1;
        }
        printf("time_s %.9f\n", now() - t0);
    }
    ggml_threadpool_free(pool);
    free(work);
    f = fopen(argv[8], "wb");
    if (!f || fwrite(out->data, 1, ggml_nbytes(out), f) != ggml_nbytes(out)) {
        fprintf(stderr, "cannot write %s\n", argv[8]);
        return 1;
    }
    fclose(f);
    ggml_free(ctx);
    return 0;
}
