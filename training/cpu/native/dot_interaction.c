/* The DLRM dot interaction on CPU in fp32, forward and backward, one sample at a time.
 *
 * A sample's V = F + 1 vectors of D floats are its dense vector (dense + b·D) and its F
 * pooled embeddings (sparse + b·F·D). Forward writes out[b] = [dense, p(0,1), p(0,2), …,
 * p(0,F), p(1,2), …, p(F−1,F), 0 …] of `width` floats, p(i,j) = ⟨v_i, v_j⟩: the upper
 * triangle of the V × V Gram matrix, row by row, diagonal excluded (TorchRec's order).
 * Backward takes that layout's gradient g and returns
 *     ∂v_i = Σ_{j≠i} g(i,j) · v_j      (g symmetric: g(j,i) = g(i,j))
 * with the dense part of g added to ∂v_0.
 *
 * Why one sample at a time: its vectors (27 × 16 floats for the benchmark model) stay in
 * L1, so the pairs are computed where they are; the same work through torch is a stack of
 * the vectors, a batched matrix product of 27 × 16 × 27 matrices, a gather of the pairs,
 * and in backward two scatters and a second product, each a pass over [B, V, V] in memory.
 * Forward computes the Gram matrix's 8 × 8 blocks on and above the diagonal from the
 * vectors and a transposed copy (a broadcast and a fused multiply-add per element of D,
 * 8 rows at a time); backward keeps 8 rows' ∂v_i in registers and adds g(i,j) · v_j over
 * j. The batch is split over `threads` threads.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__GNUC__) && defined(__x86_64__) && defined(__linux__)
#define VECTOR_CLONES __attribute__((target_clones("arch=x86-64-v3", "default")))  /* AVX2 with FMA */
#else
#define VECTOR_CLONES
#endif

#define LANES 8
/* Rows computed together: 8 independent sums, enough to keep two FMA units busy through
 * their latency (one running sum would wait ~4 cycles for every element). */
#define GROUP 8
typedef float lanes __attribute__((vector_size(LANES * sizeof(float))));

#define MAX_THREADS 256

struct shape {
    int64_t batch, features, dim, width;
};

/* Short copies (a vector, a row of pairs): inline loops, not a libc call each. */
static inline void copy_floats(float *restrict target, const float *restrict source, int64_t count) {
    for (int64_t k = 0; k < count; ++k) target[k] = source[k];
}

static inline int64_t round_up(int64_t value, int64_t multiple) { return (value + multiple - 1) / multiple * multiple; }

/* A sample's work memory, 32-byte aligned, sizes rounded up to whole vectors and groups
 * (V' = round_up(V, 8), D' = round_up(D, 8); the rounding is zeros):
 *   rows [V'][D']: the vectors;  columns [D'][V']: the same, transposed;
 *   gram [V'][V']: products (forward) or pair gradients (backward);  grads [V'][D']. */
struct work {
    float *rows, *columns, *gram, *grads;
};

static size_t work_floats(const struct shape *s) {
    const size_t vectors = round_up(s->features + 1, GROUP), dim = round_up(s->dim, LANES);
    return 3 * vectors * dim + vectors * vectors;
}

static void layout_work(float *memory, const struct shape *s, struct work *w) {
    const int64_t vectors = round_up(s->features + 1, GROUP), dim = round_up(s->dim, LANES);
    memset(memory, 0, sizeof(float) * work_floats(s));
    w->rows = memory;
    w->columns = w->rows + vectors * dim;
    w->grads = w->columns + vectors * dim;
    w->gram = w->grads + vectors * dim;
}

/* Copies sample b's vectors into w->rows (and w->columns when `transposed`). */
static inline void load_vectors(const float *dense, const float *sparse, const struct shape *s, int64_t b,
                                const struct work *w, int transposed) {
    const int64_t vectors = s->features + 1, dim = s->dim, padded_dim = round_up(dim, LANES);
    const int64_t padded_vectors = round_up(vectors, GROUP);
    for (int64_t i = 0; i < vectors; ++i) {
        const float *v = i == 0 ? dense + b * dim : sparse + (b * s->features + i - 1) * dim;
        copy_floats(w->rows + i * padded_dim, v, dim);
        if (transposed)
            for (int64_t d = 0; d < dim; ++d) w->columns[d * padded_vectors + i] = v[d];
    }
}

VECTOR_CLONES static void forward_samples(const float *dense, const float *sparse, float *out, const struct shape *s,
                                          int64_t first, int64_t last, const struct work *w) {
    const int64_t vectors = s->features + 1, dim = s->dim, pairs = vectors * (vectors - 1) / 2;
    const int64_t padded_dim = round_up(dim, LANES), padded_vectors = round_up(vectors, GROUP);
    for (int64_t b = first; b < last; ++b) {
        load_vectors(dense, sparse, s, b, w, 1);
        /* the Gram matrix's 8 × 8 blocks on and above the diagonal */
        for (int64_t top = 0; top < padded_vectors; top += GROUP) {
            for (int64_t block = top; block < padded_vectors; block += LANES) {
                lanes sums[GROUP] = {{0}};
                for (int64_t d = 0; d < padded_dim; ++d) {
                    const lanes column = *(const lanes *)(w->columns + d * padded_vectors + block);
                    for (int r = 0; r < GROUP; ++r) sums[r] += w->rows[(top + r) * padded_dim + d] * column;
                }
                for (int r = 0; r < GROUP; ++r) *(lanes *)(w->gram + (top + r) * padded_vectors + block) = sums[r];
            }
        }
        float *target = out + b * s->width;
        copy_floats(target, dense + b * dim, dim);
        float *pair = target + dim;
        for (int64_t i = 0; i + 1 < vectors; ++i) {
            copy_floats(pair, w->gram + i * padded_vectors + i + 1, vectors - 1 - i);
            pair += vectors - 1 - i;
        }
        for (int64_t k = dim + pairs; k < s->width; ++k) target[k] = 0.0f;
    }
}

VECTOR_CLONES static void backward_samples(const float *grad, const float *dense, const float *sparse,
                                           float *grad_dense, float *grad_sparse, const struct shape *s,
                                           int64_t first, int64_t last, const struct work *w) {
    const int64_t vectors = s->features + 1, dim = s->dim;
    const int64_t padded_dim = round_up(dim, LANES), padded_vectors = round_up(vectors, GROUP);
    for (int64_t b = first; b < last; ++b) {
        load_vectors(dense, sparse, s, b, w, 0);
        const float *g = grad + b * s->width + dim;
        for (int64_t i = 0; i < vectors; ++i)
            for (int64_t j = i + 1; j < vectors; ++j) w->gram[i * padded_vectors + j] = w->gram[j * padded_vectors + i] = *g++;
        for (int64_t top = 0; top < vectors; top += GROUP) {
            for (int64_t d = 0; d < padded_dim; d += LANES) {
                lanes sums[GROUP] = {{0}};
                for (int64_t j = 0; j < vectors; ++j) {
                    const lanes v = *(const lanes *)(w->rows + j * padded_dim + d);
                    for (int r = 0; r < GROUP; ++r) sums[r] += w->gram[(top + r) * padded_vectors + j] * v;
                }
                for (int r = 0; r < GROUP; ++r) *(lanes *)(w->grads + (top + r) * padded_dim + d) = sums[r];
            }
        }
        const float *direct = grad + b * s->width;  /* the dense vector passes through to the output */
        for (int64_t d = 0; d < dim; ++d) grad_dense[b * dim + d] = direct[d] + w->grads[d];
        for (int64_t i = 1; i < vectors; ++i)
            copy_floats(grad_sparse + (b * s->features + i - 1) * dim, w->grads + i * padded_dim, dim);
    }
}

struct task {
    const float *grad, *dense, *sparse;
    float *out, *grad_dense, *grad_sparse;
    struct shape shape;
    int64_t first, last;
    int failed;
};

static void *run(void *argument) {
    struct task *t = argument;
    float *memory = aligned_alloc(32, round_up(sizeof(float) * work_floats(&t->shape), 32));
    if (memory == NULL) {
        t->failed = 1;
        return NULL;
    }
    struct work w;
    layout_work(memory, &t->shape, &w);
    if (t->out != NULL)
        forward_samples(t->dense, t->sparse, t->out, &t->shape, t->first, t->last, &w);
    else
        backward_samples(t->grad, t->dense, t->sparse, t->grad_dense, t->grad_sparse, &t->shape, t->first, t->last, &w);
    free(memory);
    return NULL;
}

/* Runs the task over the batch in `threads` contiguous slices. Built with OpenMP inside a
 * torch process, the slices run on torch's own OpenMP threads (the process loads one
 * libgomp.so.1): a thread of our own would share a core with torch's, which spin for a
 * while after each of its parallel regions. Without OpenMP the slices run one by one.
 * Returns 0, or −1 when work memory could not be had. */
static int split(struct task *base, int64_t threads) {
    struct task tasks[MAX_THREADS];
    const int64_t batch = base->shape.batch;
    if (threads > batch) threads = batch;
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    if (threads < 1) threads = 1;
    for (int64_t t = 0; t < threads; ++t) {
        tasks[t] = *base;
        tasks[t].first = batch * t / threads;
        tasks[t].last = batch * (t + 1) / threads;
    }
    int failed = 0;
#pragma omp parallel for num_threads(threads) schedule(static, 1) reduction(| : failed)
    for (int64_t t = 0; t < threads; ++t) {
        run(&tasks[t]);
        failed |= tasks[t].failed;
    }
    return failed ? -1 : 0;
}

int dlrm_dot_forward(const float *dense, const float *sparse, float *out, int64_t batch, int64_t features,
                     int64_t dim, int64_t width, int64_t threads) {
    struct task task = {.dense = dense, .sparse = sparse, .out = out, .shape = {batch, features, dim, width}};
    return split(&task, threads);
}

int dlrm_dot_backward(const float *grad, const float *dense, const float *sparse, float *grad_dense,
                      float *grad_sparse, int64_t batch, int64_t features, int64_t dim, int64_t width,
                      int64_t threads) {
    struct task task = {.grad = grad, .dense = dense, .sparse = sparse, .grad_dense = grad_dense,
                        .grad_sparse = grad_sparse, .shape = {batch, features, dim, width}};
    return split(&task, threads);
}
