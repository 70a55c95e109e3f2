#include "arena.hpp"

#include <cstdlib>
#include <mutex>
#include <vector>

#ifdef __linux__
#include <sys/mman.h>
#endif

namespace mirrorsd_kern {

namespace {

constexpr size_t kHugePage = size_t{2} << 20;
constexpr size_t kChunk = size_t{32} << 20;  // a B larger than half of this gets a chunk of its own
constexpr size_t kAlign = 64;                // the SIMD paths' aligned loads

struct Chunk {
  uint8_t* base = nullptr;
  size_t size = 0;  // whole 2 MiB pages
  size_t used = 0;  // bytes carved so far, from base
  size_t live = 0;  // parts not released yet
};

struct Arena {
  std::mutex mutex;
  std::vector<Chunk> chunks;  // the last one is the one new parts are carved from

  static Chunk reserve(size_t bytes) {
    Chunk chunk;
    chunk.size = (bytes + kHugePage - 1) / kHugePage * kHugePage;
    void* memory = nullptr;
    if (posix_memalign(&memory, kHugePage, chunk.size) != 0) return Chunk{};
#ifdef __linux__
    madvise(memory, chunk.size, MADV_HUGEPAGE);  // before the first touch
#endif
    chunk.base = static_cast<uint8_t*>(memory);
    return chunk;
  }

  uint8_t* allocate(size_t bytes) {
    const size_t padded = ((bytes ? bytes : 1) + kAlign - 1) / kAlign * kAlign;  // whole cache lines
    std::lock_guard<std::mutex> lock(mutex);
    if (padded > kChunk / 2) {  // its own chunk, placed before the shared one so that carving goes on there
      Chunk own = reserve(padded);
      if (!own.base) return nullptr;
      own.used = padded, own.live = 1;
      chunks.insert(chunks.empty() ? chunks.end() : chunks.end() - 1, own);
      return own.base;
    }
    if (chunks.empty() || chunks.back().size - chunks.back().used < padded) {
      Chunk fresh = reserve(kChunk);
      if (!fresh.base) return nullptr;
      chunks.push_back(fresh);
    }
    Chunk& chunk = chunks.back();
    uint8_t* part = chunk.base + chunk.used;
    chunk.used += padded, chunk.live += 1;
    return part;
  }

  void release(uint8_t* p) {
    if (!p) return;
    std::lock_guard<std::mutex> lock(mutex);
    for (size_t i = 0; i < chunks.size(); ++i) {
      Chunk& chunk = chunks[i];
      if (p < chunk.base || p >= chunk.base + chunk.size) continue;
      if (--chunk.live == 0) {
        std::free(chunk.base);
        chunks.erase(chunks.begin() + static_cast<std::ptrdiff_t>(i));
      }
      return;
    }
  }

  ArenaCounts counts() {
    std::lock_guard<std::mutex> lock(mutex);
    ArenaCounts out;
    for (const Chunk& chunk : chunks) out.chunks += 1, out.reserved += chunk.size, out.live += chunk.live;
    return out;
  }
};

Arena& arena() {
  static Arena* instance = new Arena();  // never destroyed: kernels may be released during static destruction
  return *instance;
}

}  // namespace

uint8_t* arena_allocate(size_t bytes) { return arena().allocate(bytes); }
void arena_release(uint8_t* p) { arena().release(p); }
ArenaCounts arena_counts() { return arena().counts(); }

}  // namespace mirrorsd_kern
