/* XXH3-64 entry points of one build of xxHash: kvtier_native.c's own (the baseline:
 * SSE2 on x86_64, NEON on aarch64) or xxh3_avx2.c's, picked once at import. */
#ifndef KVTIER_XXH3_DISPATCH_H
#define KVTIER_XXH3_DISPATCH_H

#include <stddef.h>
#include <stdint.h>

typedef struct {
    const char *name;
    uint64_t (*hash)(const void *data, size_t len);
    /* streaming, on an XXH3_state_t (the same layout in every build) */
    int (*reset)(void *state);
    int (*update)(void *state, const void *data, size_t len);
    uint64_t (*digest)(const void *state);
} kvtier_xxh3;

/* Fills *out with the AVX2 build and returns 1 where this CPU runs it, else 0. */
int kvtier_xxh3_avx2(kvtier_xxh3 *out);

#endif
