/* mlp_main.c: one SGD step of examples/mlp.tg from C, through libmlp.so and mlp.h.
 *
 * Inputs are made from closed formulas (so a test can rebuild them in numpy);
 * the program prints the loss, the mean of the class probabilities and a few
 * updated weights, then runs a second step to show the update took effect.
 *
 * BLAS: by default the library's own choice, mlp_init_default() (what `tgc build
 * --blas` linked; nothing with the default --blas=none, and then the products run
 * tgc's loops). Compiled with -DMLP_CALLER_BLAS and linked with a CBLAS (e.g.
 * Debian's libopenblas-dev: -lopenblas), the driver passes that BLAS itself:
 *
 *   tgc build examples/mlp.tg -o out/libmlp.so
 *   cc -O2 -DMLP_CALLER_BLAS -Iout -o mlp_main examples/c/mlp_main.c -Lout -lmlp \
 *      -Wl,-rpath,'$ORIGIN' -lopenblas -lm
 *   ./mlp_main 512          # a batch of 512: large enough products to go to BLAS
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include "mlp.h"

#ifdef MLP_CALLER_BLAS
#include <cblas.h>

/* The caller's CBLAS through the init table. Its size arguments' width matters: an
   OpenBLAS says (blasint: 64 bits when built with INTERFACE64=1); a plain CBLAS is LP64. */
static int32_t init_with_caller_blas(void) {
#ifdef OPENBLAS_VERSION
    return mlp_init_blas((int32_t)(8 * sizeof(blasint)), (void*)cblas_sgemm, (void*)cblas_dgemm,
                         (void*)openblas_get_num_threads, (void*)openblas_set_num_threads);
#else
    return mlp_init_blas(32, (void*)cblas_sgemm, (void*)cblas_dgemm, NULL, NULL);
#endif
}
#endif

enum { FEATURES = 13, HIDDEN = 64, CLASSES = 3 };

static float* filled(int64_t n, double scale, double freq, double phase) {
    float* a = malloc(sizeof(float) * (size_t)(n ? n : 1));
    for (int64_t i = 0; i < n; i++) a[i] = (float)(scale * sin(freq * (double)i + phase));
    return a;
}

int main(int argc, char** argv) {
    int64_t batch = argc > 1 ? atoll(argv[1]) : 8;
    int64_t dims[MLP_NUM_DIMS] = {batch};
    float* x = filled(batch * FEATURES, 1.0, 0.37, 0.1);
    float* y = calloc((size_t)(batch * CLASSES), sizeof(float));
    for (int64_t b = 0; b < batch; b++) y[b * CLASSES + b % CLASSES] = 1.0f;
    float* w1 = filled(FEATURES * HIDDEN, 0.3, 0.71, 0.2);
    float* b1 = filled(HIDDEN, 0.05, 0.13, 0.3);
    float* w2 = filled(HIDDEN * CLASSES, 0.3, 0.53, 0.4);
    float* b2 = filled(CLASSES, 0.05, 1.1, 0.5);
    float lr = 0.1f;
    float loss = 0.0f;
    float* correct = malloc(sizeof(float) * (size_t)batch);
    float* probs = malloc(sizeof(float) * (size_t)(batch * CLASSES));

    void* args[MLP_NUM_ARGS];
    args[MLP_ARG_X] = x; args[MLP_ARG_Y] = y; args[MLP_ARG_W1] = w1; args[MLP_ARG_B1] = b1;
    args[MLP_ARG_W2] = w2; args[MLP_ARG_B2] = b2; args[MLP_ARG_LR] = &lr;
    void* outs[MLP_NUM_OUTS];
    outs[MLP_OUT_LOSS] = &loss; outs[MLP_OUT_CORRECT] = correct; outs[MLP_OUT_PROBS] = probs;

#ifdef MLP_CALLER_BLAS
    if (init_with_caller_blas() != 0) { fprintf(stderr, "mlp_init_blas failed\n"); return 1; }
#else
    if (mlp_init_default() != 0) { fprintf(stderr, "mlp_init_default failed\n"); return 1; }
#endif
    int64_t bytes = mlp_workspace_bytes(dims);
    void* workspace = aligned_alloc(64, (size_t)(bytes > 0 ? bytes : 64));
    for (int step = 0; step < 2; step++) {
        int32_t rc = mlp_run(dims, args, outs, workspace);
        if (rc != MLP_OK) { fprintf(stderr, "mlp_run failed: %d\n", rc); return 1; }
        double mean = 0.0;
        for (int64_t i = 0; i < batch * CLASSES; i++) mean += probs[i];
        printf("step %d loss %.7g probs_mean %.7g W2[0] %.7g b1[0] %.7g\n",
               step, loss, mean / (double)(batch * CLASSES), w2[0], b1[0]);
    }
    free(workspace); free(x); free(y); free(w1); free(b1); free(w2); free(b2); free(correct); free(probs);
    return 0;
}
