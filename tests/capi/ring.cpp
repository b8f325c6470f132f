// A ring through the C++ API (flagcx::Comm): the id from rank 0 through a file, device
// buffers, a grouped exchange with every byte checked, and exceptions with their kind for a
// bad peer and for mismatched sizes.
#include <flagcx/comm.hpp>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <thread>
#include <vector>

static int env_int(const char *name) {
  const char *v = std::getenv(name);
  if (!v) {
    std::cerr << name << " is not set\n";
    std::exit(2);
  }
  return std::atoi(v);
}

static std::string share_id(int rank) {
  std::string path = std::getenv("FLAGCX_TEST_ID_FILE");
  if (rank == 0) {
    std::string id = flagcx::Comm::unique_id();
    std::ofstream(path + ".tmp") << id;
    std::rename((path + ".tmp").c_str(), path.c_str());
    return id;
  }
  for (int i = 0; i < 30000; i++) {
    std::ifstream f(path);
    std::string id;
    if (f >> id && !id.empty()) return id;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  std::cerr << "no id at " << path << "\n";
  std::exit(1);
}

#define EXPECT(cond, msg)                                                      \
  do {                                                                         \
    if (!(cond)) {                                                             \
      std::cerr << __FILE__ << ":" << __LINE__ << ": " << #cond << ": " << msg \
                << "\n";                                                       \
      return 1;                                                                \
    }                                                                          \
  } while (0)

int main() {
  int rank = env_int("FLAGCX_RANK"), n = env_int("FLAGCX_NRANKS");
  int next = (rank + 1) % n, prev = (rank + n - 1) % n;
  try {
    flagcx::Comm comm(n, rank, share_id(rank));
    EXPECT(comm.rank() == rank && comm.size() == n, "rank " << comm.rank());
    const std::size_t bytes = (3u << 20) + 5;
    void *s = comm.alloc(bytes), *r = comm.alloc(bytes);
    std::vector<unsigned char> host(bytes);
    for (std::size_t i = 0; i < bytes; i++) host[i] = (unsigned char)(i * 13 + rank * 101);
    comm.write(s, host.data(), bytes);
    comm.group([&] {
      comm.send(s, bytes, next);
      comm.recv(r, bytes, prev);
    });
    comm.wait_all();
    comm.read(host.data(), r, bytes);
    for (std::size_t i = 0; i < bytes; i++)
      EXPECT(host[i] == (unsigned char)(i * 13 + prev * 101), "byte " << i);

    // All-reduce of int32 sums, in place: element i is the sum over ranks of i + rank.
    const std::size_t count = 100003;
    std::vector<std::int32_t> ints(count);
    for (std::size_t i = 0; i < count; i++) ints[i] = (std::int32_t)(i + rank);
    comm.write(s, ints.data(), count * 4);
    comm.all_reduce(s, s, count, flagcx::DataType::Int32, flagcx::ReduceOp::Sum);
    comm.wait_all();
    comm.read(ints.data(), s, count * 4);
    for (std::size_t i = 0; i < count; i++)
      EXPECT(ints[i] == (std::int32_t)(n * i + n * (n - 1) / 2), "all-reduce element " << i);
    // Reduce of float maxima to the last rank, recv nullptr elsewhere.
    std::vector<float> fl(count);
    for (std::size_t i = 0; i < count; i++) fl[i] = (float)((i * 7 + rank * 3) % 11);
    comm.write(s, fl.data(), count * 4);
    comm.reduce(s, rank == n - 1 ? r : nullptr, count, flagcx::DataType::Float32,
                flagcx::ReduceOp::Max, n - 1);
    comm.wait_all();
    if (rank == n - 1) {
      comm.read(fl.data(), r, count * 4);
      for (std::size_t i = 0; i < count; i++) {
        float m = 0;
        for (int q = 0; q < n; q++) m = std::max(m, (float)((i * 7 + q * 3) % 11));
        EXPECT(fl[i] == m, "reduce element " << i);
      }
    }

    try {
      comm.send(s, bytes, n);
      EXPECT(false, "a bad peer must throw");
    } catch (const flagcx::Error &e) {
      EXPECT(e.kind() == flagcx::ErrorKind::InvalidArgument, e.what());
    }
    if (n >= 2 && rank < 2) {
      // Mismatched sizes: both sides throw SizeMismatch.
      if (rank == 0)
        comm.send(s, bytes, 1);
      else
        comm.recv(r, bytes - 1, 0);
      try {
        comm.wait_all();
        EXPECT(false, "a size mismatch must throw");
      } catch (const flagcx::Error &e) {
        EXPECT(e.kind() == flagcx::ErrorKind::SizeMismatch, e.what());
      }
    }
    comm.check();
    comm.free(s);
    comm.free(r);
    std::cout << "cxx ring ok: rank " << rank << " of " << n << " on " << comm.vendor()
              << " device " << comm.device() << "\n";
  } catch (const flagcx::Error &e) {
    std::cerr << "rank " << rank << ": flagcx::Error " << int(e.kind()) << ": " << e.what() << "\n";
    return 1;
  }
  return 0;
}
