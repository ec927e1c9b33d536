/* copy_stream: memcpy for KV blocks leaving this process (kvfabric's shm pushes into a
 * decode worker's pool), with non-temporal stores.
 *
 * glibc's memcpy switches to non-temporal stores only above a threshold derived from
 * the last-level cache (hundreds of MB on a large host), so a KV transfer of a few MB
 * goes through the cache: every destination line is first read (read-for-ownership),
 * then written back later, and the copy evicts the sender's and the receiver's working
 * sets. Streaming stores write whole lines straight to memory: a third less traffic,
 * nothing evicted. The destination is the decode pool, which this process never reads
 * back. Bytes before the first 64-byte boundary of dst and after the last one go through
 * memcpy; an sfence at the end orders the streamed data before whatever the caller does
 * next (kvfabric's `ready` message). Without SSE2 (not x86-64) it is memcpy.
 */
#include <stdint.h>
#include <string.h>

#if defined(__AVX512F__) || defined(__AVX__) || defined(__SSE2__)
#include <immintrin.h>
#endif

void copy_stream(void *dst, const void *src, int64_t nbytes) {
    char *d = dst;
    const char *s = src;
#if defined(__AVX512F__) || defined(__AVX__) || defined(__SSE2__)
    const int64_t head = (int64_t)((64 - ((uintptr_t)d & 63)) & 63);
    if (nbytes < head + 64) {
        memcpy(d, s, (size_t)nbytes);
        return;
    }
    memcpy(d, s, (size_t)head);
    d += head, s += head, nbytes -= head;
    for (; nbytes >= 64; d += 64, s += 64, nbytes -= 64) {
#if defined(__AVX512F__)
        _mm512_stream_si512((void *)d, _mm512_loadu_si512((const void *)s));
#elif defined(__AVX__)
        _mm256_stream_si256((__m256i *)d, _mm256_loadu_si256((const __m256i *)s));
        _mm256_stream_si256((__m256i *)(d + 32), _mm256_loadu_si256((const __m256i *)(s + 32)));
#else
        for (int i = 0; i < 64; i += 16)
            _mm_stream_si128((__m128i *)(d + i), _mm_loadu_si128((const __m128i *)(s + i)));
#endif
    }
    _mm_sfence();
#endif
    memcpy(d, s, (size_t)nbytes);
}
