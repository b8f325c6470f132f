/* Copy bandwidth with plain stores (memcpy) against streaming (non-temporal) stores, the two
 * ways the host vendor copies (adaptors/host/src/copy.rs), on 1..N threads that split each copy
 * into equal pieces as the copy pool does. No library code.
 * Build: cc -O2 -pthread -o copy_nt copy_nt.c
 * Usage: copy_nt [threads,...] [MiB,...]   e.g. copy_nt 1,4,8 8,32,64,256 */
#define _GNU_SOURCE
#include <emmintrin.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static void copy_stream(char *dst, const char *src, size_t n) {
  size_t head = (size_t)(-(uintptr_t)dst) & 63, off;
  if (head > n) head = n;
  memcpy(dst, src, head);
  for (off = head; n - off >= 64; off += 64) {
    const __m128i *s = (const __m128i *)(src + off);
    __m128i *d = (__m128i *)(dst + off);
    __m128i a = _mm_loadu_si128(s), b = _mm_loadu_si128(s + 1);
    __m128i c = _mm_loadu_si128(s + 2), e = _mm_loadu_si128(s + 3);
    _mm_stream_si128(d, a); _mm_stream_si128(d + 1, b);
    _mm_stream_si128(d + 2, c); _mm_stream_si128(d + 3, e);
  }
  memcpy(dst + off, src + off, n - off);
  _mm_sfence();
}

struct job { char *dst; const char *src; size_t n; int streaming; };
static void *run(void *p) {
  struct job *j = p;
  if (j->streaming) copy_stream(j->dst, j->src, j->n); else memcpy(j->dst, j->src, j->n);
  return NULL;
}
static void copy(char *dst, const char *src, size_t n, int threads, int streaming) {
  pthread_t t[64]; struct job j[64];
  size_t step = ((n + threads - 1) / threads + 63) & ~(size_t)63;
  for (int i = 0; i < threads; i++) {
    size_t off = i * step, len = off < n ? (n - off < step ? n - off : step) : 0;
    j[i] = (struct job){dst + off, src + off, len, streaming};
    if (threads == 1) run(&j[i]); else pthread_create(&t[i], NULL, run, &j[i]);
  }
  if (threads > 1) for (int i = 0; i < threads; i++) pthread_join(t[i], NULL);
}
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }

int main(int argc, char **argv) {
  int threads[16], nt = 0, mibs[16], nm = 0;
  char *a = argc > 1 ? argv[1] : "1", *b = argc > 2 ? argv[2] : "8,64,512";
  for (char *p = strtok(a, ","); p && nt < 16; p = strtok(NULL, ",")) threads[nt++] = atoi(p) < 64 ? atoi(p) : 64;
  for (char *p = strtok(b, ","); p && nm < 16; p = strtok(NULL, ",")) mibs[nm++] = atoi(p);
  for (int m = 0; m < nm; m++) {
    size_t n = (size_t)mibs[m] << 20;
    char *src = malloc(n), *dst = malloc(n);
    memset(src, 7, n); memset(dst, 1, n);
    int iters = mibs[m] >= 2048 ? 4 : 2048 / mibs[m] > 200 ? 200 : 2048 / mibs[m] < 4 ? 4 : 2048 / mibs[m];
    for (int t = 0; t < nt; t++) {
      double best[2] = {1e30, 1e30};
      for (int round = 0; round < 3; round++)
        for (int s = 0; s < 2; s++) {  /* alternate the two kinds */
          copy(dst, src, n, threads[t], s);
          double t0 = now();
          for (int i = 0; i < iters; i++) copy(dst, src, n, threads[t], s);
          double dt = (now() - t0) / iters;
          if (dt < best[s]) best[s] = dt;
        }
      if (dst[0] != 7 || dst[n - 1] != 7) { fprintf(stderr, "wrong copy\n"); return 1; }
      printf("%5d MiB, %2d threads: memcpy %6.1f GB/s, streaming %6.1f GB/s\n", mibs[m], threads[t],
             n / best[0] / 1e9, n / best[1] / 1e9);
    }
    free(src); free(dst);
  }
  return 0;
}
