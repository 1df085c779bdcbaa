/* xxHash's XXH3 compiled for AVX2 (about 3x the SSE2 baseline), used only where the CPU
 * has AVX2 (checked at run time): the rest of the extension stays baseline x86_64. */
#include "xxh3_dispatch.h"

#if defined(__x86_64__) && defined(__GNUC__)
#pragma GCC target("avx2")
#define XXH_INLINE_ALL
#include "third_party/xxhash/xxhash.h"

static uint64_t hash(const void *data, size_t len)
{
    return XXH3_64bits(data, len);
}

static int reset(void *state)
{
    return XXH3_64bits_reset(state) == XXH_OK;
}

static int update(void *state, const void *data, size_t len)
{
    return XXH3_64bits_update(state, data, len) == XXH_OK;
}

static uint64_t digest(const void *state)
{
    return XXH3_64bits_digest(state);
}

int kvtier_xxh3_avx2(kvtier_xxh3 *out)
{
    __builtin_cpu_init();
    if (!__builtin_cpu_supports("avx2"))
        return 0;
    out->name = "avx2";
    out->hash = hash;
    out->reset = reset;
    out->update = update;
    out->digest = digest;
    return 1;
}
#else
int kvtier_xxh3_avx2(kvtier_xxh3 *out)
{
    (void)out;
    return 0;
}
#endif
