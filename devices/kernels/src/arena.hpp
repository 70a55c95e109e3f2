// Where packed weights live: chunks of 2 MiB pages shared by every MatMulNBits node of the process.
//
// A decode step streams every node's packed B once. Each node's own allocation put B's below 2 MiB (a 0.5B draft's
// attention projections: 0.1-0.6 MiB each) in 4 KiB pages, and the last partial 2 MiB of every larger one too; on a
// virtual machine each 4 KiB page costs a nested page walk, and a call of a few hundred KiB paid ~20 us of them.
// Here nodes are carved out of large chunks advised as huge pages, one after another, so small B's share pages.
#pragma once

#include <cstddef>
#include <cstdint>

namespace mirrorsd_kern {

// 64-byte aligned memory for one node's packed B (null when the system has none left). A chunk goes back to the
// system when the last node carved from it releases its part; until then its released parts stay unused, so sessions
// closed and opened again while others live waste at most the chunks they share with those (tests/test_kernels.py).
uint8_t* arena_allocate(size_t bytes);
void arena_release(uint8_t* p);

// What the arena holds now: chunks, bytes reserved from the system, parts not released (mirrorsd_kern_arena_counts).
struct ArenaCounts {
  size_t chunks = 0, reserved = 0, live = 0;
};
ArenaCounts arena_counts();

}  // namespace mirrorsd_kern
