/* Helpers shared by the C test programs: rank discovery from the launcher's environment and
 * the unique id handed from rank 0 to the others through a file, as an application would. */
#ifndef FLAGCX_TEST_COMMON_H
#define FLAGCX_TEST_COMMON_H

#include <flagcx.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define CHECK(call)                                                                        \
  do {                                                                                     \
    flagcxResult_t r_ = (call);                                                            \
    if (r_ != flagcxSuccess) {                                                             \
      fprintf(stderr, "%s:%d: %s -> %d (%s): %s\n", __FILE__, __LINE__, #call, (int)r_,   \
              flagcxGetErrorString(r_), flagcxGetLastError(NULL));                          \
      exit(1);                                                                             \
    }                                                                                      \
  } while (0)

#define EXPECT(cond, ...)                                                                  \
  do {                                                                                     \
    if (!(cond)) {                                                                         \
      fprintf(stderr, "%s:%d: expected %s: ", __FILE__, __LINE__, #cond);                  \
      fprintf(stderr, __VA_ARGS__);                                                        \
      fprintf(stderr, "\n");                                                               \
      exit(1);                                                                             \
    }                                                                                      \
  } while (0)

static inline int env_int(const char *name) {
  const char *v = getenv(name);
  if (!v) {
    fprintf(stderr, "%s is not set\n", name);
    exit(2);
  }
  return atoi(v);
}

/* Rank 0 makes the id and publishes it at $FLAGCX_TEST_ID_FILE (written aside, then renamed);
 * the others wait for the file. */
static inline void share_unique_id(int rank, flagcxUniqueId *id) {
  const char *path = getenv("FLAGCX_TEST_ID_FILE");
  if (!path) {
    fprintf(stderr, "FLAGCX_TEST_ID_FILE is not set\n");
    exit(2);
  }
  if (rank == 0) {
    char tmp[4096];
    snprintf(tmp, sizeof tmp, "%s.tmp", path);
    CHECK(flagcxGetUniqueId(id));
    FILE *f = fopen(tmp, "wb");
    EXPECT(f && fwrite(id, sizeof *id, 1, f) == 1 && fclose(f) == 0, "writing %s", tmp);
    EXPECT(rename(tmp, path) == 0, "renaming %s", tmp);
    return;
  }
  for (int i = 0; i < 30000; i++) {
    FILE *f = fopen(path, "rb");
    if (f) {
      size_t n = fread(id, sizeof *id, 1, f);
      fclose(f);
      if (n == 1) return;
    }
    usleep(1000);
  }
  fprintf(stderr, "rank %d: no unique id at %s after 30 s\n", rank, path);
  exit(1);
}

static inline unsigned char pattern(int src, size_t i) { return (unsigned char)(i * 31u + src * 7u + (i >> 9)); }

#endif
