/* Exact row-wise Adagrad for fbgemm's CPU embedding backward: one pass over the ids.
 *
 * For each table and each distinct row r among its ids, with g the sum of the row's
 * occurrences' gradients (feature by feature, in batch order, as fbgemm sums them):
 *
 *     m[r] += mean(g²);  w[r] -= lr · g / (√m[r] + eps)
 *
 * with g += weight_decay · w[r] first when weight_decay is set (fbgemm's L2 mode: the decay
 * of a row applies on the steps that touch it, through its Adagrad moment too).
 *
 * Arguments follow fbgemm's op (split_embedding_backward_codegen_rowwise_adagrad_cpu):
 * ids of bag f·B + b are indices[offsets[f·B + b] : offsets[f·B + b + 1]]; feature f's
 * weights and moments start at weights_offsets[f] and momentum_offsets[f]. The caller adds:
 *   - the gradient of feature f, sample b at grad + grad_start[f] + b · grad_sample_stride
 *     (a feature-major copy [F, B, D] makes each feature's reads sequential: read straight
 *     from fbgemm's [B, ΣD], every feature walks all of its pages again);
 *   - `order`: the features grouped by table, groups ending where group_end[i] is set
 *     (features that share a table update its rows once, with their gradients summed);
 *   - work memory for the largest group: an open-addressing table of up to 2^hash_bits
 *     (row, slot) pairs, `sums` [ids, max_dim] and `rows` [ids].
 * Returns the number of rows updated.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__GNUC__) && defined(__x86_64__) && defined(__linux__)
#define VECTOR_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define VECTOR_CLONES
#endif

/* Rows to prefetch ahead while updating: the rows are scattered over tables far larger
 * than the caches, so each would otherwise wait for memory in turn. */
#define PREFETCH_AHEAD 16

VECTOR_CLONES static void add_scaled(float *sum, const float *grad, float scale, int64_t dim) {
    for (int64_t d = 0; d < dim; ++d) sum[d] += scale * grad[d];
}

VECTOR_CLONES static void update_row(float *weights, float *moment, float *sum, int64_t dim, float lr,
                                     float eps, float weight_decay) {
    if (weight_decay != 0.0f)
        for (int64_t d = 0; d < dim; ++d) sum[d] += weight_decay * weights[d];
    float squares = 0.0f;
    for (int64_t d = 0; d < dim; ++d) squares += sum[d] * sum[d];
    *moment += squares / (float)dim;
    const float step = -lr / (sqrtf(*moment) + eps);
    for (int64_t d = 0; d < dim; ++d) weights[d] += sum[d] * step;
}

static inline uint64_t bucket(int64_t row, int64_t bits) {
    return ((uint64_t)row * 0x9E3779B97F4A7C15ull) >> (64 - bits);
}

int64_t dlrm_rowwise_adagrad(const float *grad, const int64_t *grad_start, int64_t grad_sample_stride,
                             float *weights, const int64_t *weights_offsets, float *momentum,
                             const int64_t *momentum_offsets, const int64_t *D_offsets, int64_t batch,
                             const int64_t *indices, const int64_t *offsets, const float *indice_weights,
                             int32_t mean_pooling, float lr, float eps, float weight_decay, const int64_t *order,
                             const uint8_t *group_end, int64_t features, int64_t *hash, int64_t hash_bits,
                             float *sums, int64_t *rows, int64_t max_dim) {
    int64_t updated = 0, group_start = 0;
    for (int64_t i = 0; i < features; ++i) {
        if (!group_end[i]) continue;
        const int64_t lead = order[group_start];  /* any feature of the group: they share the table */
        const int64_t dim = D_offsets[lead + 1] - D_offsets[lead];
        int64_t distinct = 0, ids = 0;
        for (int64_t k = group_start; k <= i; ++k) ids += offsets[(order[k] + 1) * batch] - offsets[order[k] * batch];
        if (dim > 0 && ids > 0) {
            /* this group's own size, at most half full: a small group clears a small table */
            int64_t bits = 1;
            while (bits < hash_bits && (1ll << bits) < 2 * ids) ++bits;
            const uint64_t mask = (1ull << bits) - 1;
            memset(hash, 0xff, sizeof(int64_t) << (bits + 1));  /* every row -1: empty */
            for (int64_t k = group_start; k <= i; ++k) {
                const int64_t f = order[k];
                for (int64_t b = 0; b < batch; ++b) {
                    const int64_t begin = offsets[f * batch + b], end = offsets[f * batch + b + 1];
                    if (end == begin) continue;
                    const float *g = grad + grad_start[f] + b * grad_sample_stride;
                    const float pooled = mean_pooling ? 1.0f / (float)(end - begin) : 1.0f;
                    for (int64_t id = begin; id < end; ++id) {
                        const int64_t row = indices[id];
                        uint64_t h = bucket(row, bits);
                        while (hash[2 * h] != row && hash[2 * h] != -1) h = (h + 1) & mask;
                        if (hash[2 * h] == -1) {
                            hash[2 * h] = row;
                            hash[2 * h + 1] = distinct;
                            rows[distinct] = row;
                            memset(sums + distinct * max_dim, 0, (size_t)dim * sizeof(float));
                            ++distinct;
                        }
                        add_scaled(sums + hash[2 * h + 1] * max_dim, g,
                                   indice_weights ? pooled * indice_weights[id] : pooled, dim);
                    }
                }
            }
            float *table_weights = weights + weights_offsets[lead];
            float *table_moments = momentum + momentum_offsets[lead];
            for (int64_t s = 0; s < distinct; ++s) {
                if (s + PREFETCH_AHEAD < distinct) {
                    const int64_t later = rows[s + PREFETCH_AHEAD];
                    __builtin_prefetch(table_weights + later * dim, 1);
                    __builtin_prefetch(table_weights + later * dim + dim - 1, 1);
                    __builtin_prefetch(table_moments + later, 1);
                }
                update_row(table_weights + rows[s] * dim, table_moments + rows[s], sums + s * max_dim, dim, lr, eps,
                           weight_decay);
            }
        }
        updated += distinct;
        group_start = i + 1;
    }
    return updated;
}
