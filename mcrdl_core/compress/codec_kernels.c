/* The host codecs' inner loops in C: int8, fp8 (e4m3) and fp16 on float32 data.

   Plain C with no Python headers: mcrdl_core/compress/native.py loads the built library
   with ctypes, and `python -m mcrdl_core.tools.build_codecs` (run by `make install`)
   compiles it. Each entry point does, block by block, what the NumPy code of
   codecs.py does array by array, with the same float32 arithmetic in the same order, so
   the bytes and the decoded values are identical (tests/test_codec_kernels.py checks
   this against the Python path). Where a block needs that code's slower branches (a
   NaN or Inf in it, a maximum in float32's subnormals, a scale outside float32's normal
   range), the entry point returns 1 and the caller runs the Python path for the whole
   call, which rewrites every byte: the rare inputs keep one implementation.

   Why: the NumPy/torch path makes 4-6 passes over memory per block (maximum and
   minimum, the product, the rounding, the cast), each through a temporary; here each
   block of 128-1024 values is read twice while it sits in L1. Where four ranks share
   two cores, encoding is on the critical path of a compressed all-to-all.

   Build flags matter for the "same bits" claim: -ffp-contract=off (no fused
   multiply-add), no -ffast-math. Rounding to nearest even uses the 1.5 * 2^23 trick,
   exact for |y| < 2^22 in the default rounding mode.

   The floating-point mode is part of the claim too: the same bytes on every thread,
   whatever its mode. A thread may run with flush-to-zero and denormals-are-zero set
   (XLA's threads, where a jax.jit host callback runs; torch.set_flush_denormal(True)),
   or another rounding mode; then a subnormal input or product becomes zero and the
   1.5 * 2^23 trick rounds the wrong way. So every entry point runs in IEEE's default
   mode (fp_exact_enter/leave: MXCSR's FTZ, DAZ and rounding bits on x86-64, FPCR's on
   AArch64, cleared for the call and restored after it; a read of the register where
   they are clear already), and mcrdl_fp_exact_enter/leave let the Python path of the
   codecs do the same around all of its NumPy and torch arithmetic. The decoders also
   build each code's value without a subnormal float32 (an e4m3 or float16 subnormal
   code is its integer significand times a power of two), so they need no mode. */
#include <stdint.h>
#include <string.h>
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#include <immintrin.h>
#define HAVE_F16C_PATH 1
#endif

#define KERNELS_VERSION 3

/* Compile each entry point for AVX2 and for the x86-64 baseline, chosen at load. */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define CLONES __attribute__((target_clones("avx2", "default")))
#else
#define CLONES
#endif

#define FLAG 0x80000000u
#define EXP_BIAS 1100
#define E4M3_MIN_NORMAL_BITS 0x3C800000u /* 2^-6 */
#define MAGIC 12582912.0f                 /* 1.5 * 2^23 */

int mcrdl_codec_kernels_version(void) { return KERNELS_VERSION; }

static inline uint32_t bits_of(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

static inline float float_of(uint32_t u)
{
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* The thread's floating-point mode bits that change results: x86-64's MXCSR FTZ
   (bit 15), DAZ (bit 6) and rounding control (bits 13-14); AArch64's FPCR FZ (24),
   FZ16 (19) and rounding mode (22-23). All clear is IEEE's default mode. */
#if defined(__x86_64__) || defined(__i386__)
#include <xmmintrin.h>
#define FP_MODE_BITS 0xE040u
static inline uint32_t fp_mode_get(void) { return _mm_getcsr(); }
static inline void fp_mode_set(uint32_t m) { _mm_setcsr(m); }
#elif defined(__aarch64__)
#define FP_MODE_BITS ((1u << 24) | (1u << 19) | (3u << 22))
static inline uint32_t fp_mode_get(void)
{
    uint64_t v;
    __asm__ __volatile__("mrs %0, fpcr" : "=r"(v));
    return (uint32_t)v;
}
static inline void fp_mode_set(uint32_t m)
{
    uint64_t v = m;
    __asm__ __volatile__("msr fpcr, %0" : : "r"(v));
}
#else
#define FP_MODE_BITS 0u
static inline uint32_t fp_mode_get(void) { return 0; }
static inline void fp_mode_set(uint32_t m) { (void)m; }
#endif

/* IEEE's default mode for this thread from here: returns the mode to give back to
   mcrdl_fp_exact_leave, or -1 where the thread was in it already (nothing to undo). */
int64_t mcrdl_fp_exact_enter(void)
{
    uint32_t m = fp_mode_get();
    if (!(m & FP_MODE_BITS))
        return -1;
    fp_mode_set(m & ~FP_MODE_BITS);
    return (int64_t)m;
}

/* The thread's mode as mcrdl_fp_exact_enter found it (-1: nothing to do). */
void mcrdl_fp_exact_leave(int64_t saved)
{
    if (saved >= 0)
        fp_mode_set((uint32_t)saved);
}

/* 2^k as a double, for k in float32's exponent range (exact). */
static inline double pow2(int k)
{
    uint64_t u = (uint64_t)(k + 1023) << 52;
    double d;
    memcpy(&d, &u, 8);
    return d;
}

/* The largest |x| of a block as float32 bits (bit patterns of non-negative floats
   order as their values; NaN and Inf sort above every finite one). */
static inline uint32_t absmax_bits(const uint32_t *xu, int64_t len)
{
    uint32_t mx = 0;
    for (int64_t i = 0; i < len; i++) {
        uint32_t a = xu[i] & 0x7FFFFFFFu;
        mx = a > mx ? a : mx;
    }
    return mx;
}

/* codecs._AbsmaxScaled._factors for one block whose largest magnitude has float32 bits
   `mx`: the scale word and the float32 factor LEVELS / amax'. 1: the block needs the
   Python path (non-finite, subnormal maximum, or a factor outside float32's normal
   range: `kmax` is 128 - bit_length(2 * LEVELS), as _row_factor clips). */
static inline int absmax_factor(uint32_t mx, int levels, int kmax, uint32_t *word, float *inv)
{
    if (mx >= 0x7F800000u)
        return 1;
    if (mx == 0) {
        *word = 0;
        *inv = 0.0f;
        return 0;
    }
    uint32_t ef = mx >> 23;
    if (ef == 0)
        return 1;
    int e = (int)ef - 126;                     /* amax = m * 2^e, m in [0.5, 1) */
    uint32_t frac = (mx & 0x7FFFFFu) >> 4;     /* m's 19 bits after its leading one */
    double m = 0.5 + (double)frac * 0x1p-20;
    int k = -e;
    if (k < -126 || k > kmax)
        return 1;
    *word = ((uint32_t)(e + EXP_BIAS) << 19) | frac;
    *inv = (float)(((double)levels / m) * pow2(k));
    return 0;
}

/* int8 (kind 0) or fp8 e4m3 (kind 1) encoding of n float32 values in blocks of `block`:
   words[nblocks] then payload[n], as codecs.Int8 / codecs.FP8 write them. */
CLONES static int absmax_encode(const float *x, int64_t n, int64_t block, int levels,
                                int kmax, int kind, uint32_t *words, uint8_t *payload)
{
    for (int64_t b = 0, off = 0; off < n; b++, off += block) {
        int64_t len = n - off < block ? n - off : block;
        const float *xb = x + off;
        uint8_t *pb = payload + off;
        uint32_t word;
        float inv;
        if (absmax_factor(absmax_bits((const uint32_t *)xb, len), levels, kmax, &word, &inv))
            return 1;
        words[b] = word;
        if (kind == 0) {
            for (int64_t i = 0; i < len; i++) {
                float y = xb[i] * inv;
                float t = (y + MAGIC) - MAGIC; /* rint, ties to even */
                pb[i] = (uint8_t)(int8_t)(int32_t)t;
            }
        } else {
            for (int64_t i = 0; i < len; i++) {
                float y = xb[i] * inv;
                uint32_t u = bits_of(y);
                uint32_t a = u & 0x7FFFFFFFu;
                /* normal e4m3: round float32's bits at bit 20 (ties to even), rebias the
                   exponent 127 -> 7; subnormal: rint(|y| * 2^9) is the code */
                uint32_t normal = (a + ((a >> 20) & 1u) + (0x7FFFFu - (960u << 20))) >> 20;
                float s = float_of(a) * 512.0f;
                uint32_t sub = (uint32_t)(int32_t)((s + MAGIC) - MAGIC);
                uint32_t is_sub = 0u - (uint32_t)(a < E4M3_MIN_NORMAL_BITS); /* a mask, */
                uint32_t code = (sub & is_sub) | (normal & ~is_sub);     /* no branch */
                pb[i] = (uint8_t)(code | ((u >> 24) & 0x80u));
            }
        }
    }
    return 0;
}

/* The inverse: n values into `out` from words[nblocks] and payload[n]. `lo` is
   bit_length(LEVELS) + 1, as codecs._AbsmaxScaled._unscale clips. 1: a block is
   flagged (NaN/Inf) or its step is outside float32's normal range: the Python path
   decodes the call. */
CLONES static int absmax_decode(const uint32_t *words, const uint8_t *payload, int64_t n,
                                int64_t block, int levels, int lo, int kind, float *out)
{
    for (int64_t b = 0, off = 0; off < n; b++, off += block) {
        int64_t len = n - off < block ? n - off : block;
        uint32_t w = words[b];
        if (w & FLAG)
            return 1;
        uint32_t ef = (w >> 19) & 0xFFFu;
        double m = ef == 0 ? 0.0 : 0.5 + (double)(w & 0x7FFFFu) * 0x1p-20;
        int e = ef == 0 ? 0 : (int)ef - EXP_BIAS;
        if (e < -126 + lo || e > 128)
            return 1;
        float step = (float)((m / levels) * pow2(e));
        const uint8_t *pb = payload + off;
        float *ob = out + off;
        if (kind == 0) {
            for (int64_t i = 0; i < len; i++)
                ob[i] = (float)(int8_t)pb[i] * step;
        } else {
            /* a normal e4m3 code's bits placed in a float32's, exponent rebiased 7 ->
               127, are its value; a subnormal code's is its significand times 2^-9:
               exact either way, and no subnormal float32 on the way (the NaN codes are
               not values: a block that holds one goes to the Python path, and only
               flagged blocks hold them) */
            uint32_t nan = 0;
            for (int64_t i = 0; i < len; i++) {
                uint32_t c = pb[i], mag = c & 0x7Fu;
                nan |= (uint32_t)(mag == 0x7Fu);
                float sub = (float)(int32_t)(mag & 7u) * 0x1p-9f;
                float v = mag < 8u ? sub : float_of((mag << 20) + (120u << 23));
                ob[i] = float_of(bits_of(v) | ((c & 0x80u) << 24)) * step;
            }
            if (nan)
                return 1;
        }
    }
    return 0;
}

/* The absmax entry points: the kernels above in IEEE's default mode. */
int mcrdl_absmax_encode(const float *x, int64_t n, int64_t block, int levels, int kmax,
                        int kind, uint32_t *words, uint8_t *payload)
{
    int64_t mode = mcrdl_fp_exact_enter();
    int r = absmax_encode(x, n, block, levels, kmax, kind, words, payload);
    mcrdl_fp_exact_leave(mode);
    return r;
}

int mcrdl_absmax_decode(const uint32_t *words, const uint8_t *payload, int64_t n,
                        int64_t block, int levels, int lo, int kind, float *out)
{
    int64_t mode = mcrdl_fp_exact_enter();
    int r = absmax_decode(words, payload, n, block, levels, lo, kind, out);
    mcrdl_fp_exact_leave(mode);
    return r;
}

/* fp16's exponent k for a block whose largest magnitude has float32 bits `mx` (the
   power of two 2^k that brings it into [2^14, 2^15)); 1: the block holds NaN/Inf or
   needs ldexp (a subnormal maximum, or 2^-k outside float32's normal range): the
   Python path. */
static inline int fp16_exponent(uint32_t mx, int *k)
{
    if (mx >= 0x7F800000u || (mx != 0 && (mx >> 23) == 0))
        return 1;
    *k = mx == 0 ? 0 : (int)(mx >> 23) - 126 - 15;
    return -*k < -126 || -*k > 127;
}

/* fp16 (codecs.FP16) on float32: per block the power of two 2^k that brings the
   largest finite magnitude into [2^14, 2^15) (k as an int32 word), then each value
   times 2^-k rounded to float16 (ties to even). 1: a block holds NaN/Inf or needs
   ldexp (a subnormal maximum): the Python path. */
CLONES static int fp16_encode_bits(const float *x, int64_t n, int64_t block, int32_t *words,
                                   uint16_t *payload)
{
    for (int64_t b = 0, off = 0; off < n; b++, off += block) {
        int64_t len = n - off < block ? n - off : block;
        const float *xb = x + off;
        uint16_t *hb = payload + off;
        uint32_t mx = absmax_bits((const uint32_t *)xb, len);
        int k;
        if (fp16_exponent(mx, &k))
            return 1;
        words[b] = k;
        float inv = (float)pow2(-k);
        for (int64_t i = 0; i < len; i++) {
            uint32_t u = bits_of(xb[i] * inv);
            uint32_t a = u & 0x7FFFFFFFu;
            /* normal half (|y| >= 2^-14): round at bit 13, rebias 127 -> 15 (finite
               here: |y| < 2^15); subnormal: rint(|y| * 2^24) is the code */
            uint32_t normal = (a + 0xFFFu + ((a >> 13) & 1u) - (112u << 23)) >> 13;
            float s = float_of(a) * 16777216.0f;
            uint32_t sub = (uint32_t)(int32_t)((s + MAGIC) - MAGIC);
            uint32_t is_sub = 0u - (uint32_t)(a < 0x38800000u);
            uint32_t h = (sub & is_sub) | (normal & ~is_sub);
            hb[i] = (uint16_t)(h | ((u >> 16) & 0x8000u));
        }
    }
    return 0;
}

/* A decoded block's factor 2^k; 1: outside float32's normal range (the Python path). */
static inline int fp16_scale(int32_t k, float *scale)
{
    if (k < -126 || k > 128 - 16)
        return 1;
    *scale = (float)pow2(k);
    return 0;
}

/* The inverse of mcrdl_fp16_encode: each float16 value (exact in float32) times 2^k.
   1: a block holds a float16 Inf/NaN or its 2^k is outside float32's normal range. */
CLONES static int fp16_decode_bits(const int32_t *words, const uint16_t *payload, int64_t n,
                                   int64_t block, float *out)
{
    for (int64_t b = 0, off = 0; off < n; b++, off += block) {
        int64_t len = n - off < block ? n - off : block;
        float scale;
        if (fp16_scale(words[b], &scale))
            return 1;
        const uint16_t *hb = payload + off;
        float *ob = out + off;
        uint32_t special = 0;
        for (int64_t i = 0; i < len; i++) {
            uint32_t h = hb[i];
            uint32_t a = h & 0x7FFFu;
            special |= (a >= 0x7C00u);
            /* a normal half's bits placed in a float32's, exponent rebiased 15 ->
               127, are its value; a subnormal half's is its significand times 2^-24:
               exact, and no subnormal float32 on the way (Inf/NaN: flagged above) */
            float sub = (float)(int32_t)(a & 0x3FFu) * 0x1p-24f;
            float v = a < 0x400u ? sub : float_of((a << 13) + (112u << 23));
            ob[i] = float_of(bits_of(v) | ((h & 0x8000u) << 16)) * scale;
        }
        if (special)
            return 1;
    }
    return 0;
}

/* The same two fp16 entry points on the CPU's own float32 <-> float16 conversions
   (F16C: vcvtps2ph rounding to nearest even, vcvtph2ps exact), 8 values at a time.
   They give the bit-arithmetic versions' bytes and values: the blocks they accept hold
   finite values scaled below 2^15 (no overflow), and IEEE rounding to nearest even is
   what the bit arithmetic computes, subnormal halves included (test_codec_kernels.py
   runs both against the Python path). Encoding is ~2.4x faster here (4 MiB of float32:
   0.30 ms against 0.73); decoding is bound by memory either way. Chosen at run time
   where the CPU has AVX2 and F16C, unless mcrdl_fp16_simd(0) turned them off. */
#ifdef HAVE_F16C_PATH
__attribute__((target("avx2,f16c")))
static int fp16_encode_f16c(const float *x, int64_t n, int64_t block, int32_t *words,
                            uint16_t *payload)
{
    const int rnd = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    for (int64_t b = 0, off = 0; off < n; b++, off += block) {
        int64_t len = n - off < block ? n - off : block;
        const float *xb = x + off;
        uint16_t *hb = payload + off;
        uint32_t mx = absmax_bits((const uint32_t *)xb, len); /* vectorised here */
        int k;
        if (fp16_exponent(mx, &k))
            return 1;
        words[b] = k;
        float inv = (float)pow2(-k);
        __m256 vinv = _mm256_set1_ps(inv);
        int64_t i = 0;
        for (; i + 8 <= len; i += 8) {
            __m256 y = _mm256_mul_ps(_mm256_loadu_ps(xb + i), vinv);
            _mm_storeu_si128((__m128i *)(hb + i), _mm256_cvtps_ph(y, rnd));
        }
        for (; i < len; i++)
            hb[i] = _cvtss_sh(xb[i] * inv, rnd);
    }
    return 0;
}

__attribute__((target("avx2,f16c")))
static int fp16_decode_f16c(const int32_t *words, const uint16_t *payload, int64_t n,
                            int64_t block, float *out)
{
    const __m256i expmask = _mm256_set1_epi32(0x7C00);
    for (int64_t b = 0, off = 0; off < n; b++, off += block) {
        int64_t len = n - off < block ? n - off : block;
        float scale;
        if (fp16_scale(words[b], &scale))
            return 1;
        __m256 vscale = _mm256_set1_ps(scale);
        const uint16_t *hb = payload + off;
        float *ob = out + off;
        __m256i special = _mm256_setzero_si256();
        int64_t i = 0;
        for (; i + 8 <= len; i += 8) {
            __m128i h = _mm_loadu_si128((const __m128i *)(hb + i));
            __m256i e = _mm256_and_si256(_mm256_cvtepu16_epi32(h), expmask);
            special = _mm256_or_si256(special, _mm256_cmpeq_epi32(e, expmask));
            _mm256_storeu_ps(ob + i, _mm256_mul_ps(_mm256_cvtph_ps(h), vscale));
        }
        int tail_special = 0;
        for (; i < len; i++) {
            tail_special |= (hb[i] & 0x7C00u) == 0x7C00u;
            ob[i] = _cvtsh_ss(hb[i]) * scale;
        }
        if (tail_special || !_mm256_testz_si256(special, special))
            return 1;
    }
    return 0;
}

static int f16c_on = -1; /* -1: not decided yet; then 0 or 1 */

static int use_f16c(void)
{
    if (f16c_on < 0) {
        __builtin_cpu_init();
        f16c_on = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
    }
    return f16c_on;
}

/* Turn the F16C path off (0) or back on where the CPU has it (1); -1 changes nothing.
   Returns whether it is in use now (the tests run both paths). */
int mcrdl_fp16_simd(int on)
{
    if (on == 0)
        f16c_on = 0;
    else if (on == 1)
        f16c_on = -1;
    return use_f16c();
}
#else
int mcrdl_fp16_simd(int on)
{
    (void)on;
    return 0;
}
#endif

/* fp16 entry points: the F16C versions where in use, else the bit arithmetic, in
   IEEE's default mode. */
int mcrdl_fp16_encode(const float *x, int64_t n, int64_t block, int32_t *words,
                      uint16_t *payload)
{
    int64_t mode = mcrdl_fp_exact_enter();
    int r;
#ifdef HAVE_F16C_PATH
    if (use_f16c())
        r = fp16_encode_f16c(x, n, block, words, payload);
    else
#endif
        r = fp16_encode_bits(x, n, block, words, payload);
    mcrdl_fp_exact_leave(mode);
    return r;
}

int mcrdl_fp16_decode(const int32_t *words, const uint16_t *payload, int64_t n,
                      int64_t block, float *out)
{
    int64_t mode = mcrdl_fp_exact_enter();
    int r;
#ifdef HAVE_F16C_PATH
    if (use_f16c())
        r = fp16_decode_f16c(words, payload, n, block, out);
    else
#endif
        r = fp16_decode_bits(words, payload, n, block, out);
    mcrdl_fp_exact_leave(mode);
    return r;
}
