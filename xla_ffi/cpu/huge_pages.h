// Transparent huge pages for result buffers.
#pragma once

#include <cstdint>

namespace jaxring {

// A result buffer that XLA just allocated is usually fresh memory from the
// kernel, and faulting it in 4 KiB at a time while data arrives costs about
// as much as moving the data. Asking for transparent huge pages (where the
// system allows them only on request) cuts the faults 512-fold. Advice only:
// the memory's contents and ownership are unchanged; buffers under 4 MiB are
// left alone.
//
// Where glibc keeps freed buffers for reuse (MALLOC_MMAP_THRESHOLD_ set, as
// `jaxring.launch --keep-freed-memory` does) the advice is not given: a
// result then lands on pages already faulted in, and on the fresh heap it
// does meet, the kernel's direct compaction for the advised range stalled a
// 64 MiB allreduce for 150 ms (docs/benchmarking.md, "Keeping freed
// memory"). JAXRING_HUGE_PAGES=1 or 0 decides instead.
void advise_huge_pages(void* p, int64_t bytes);

// Whether advise_huge_pages gives the advice in this process (read from the
// environment once).
bool huge_pages_advised();

}  // namespace jaxring
