// The thread team every kernel splits its work on, in one place: torch's OpenMP pool while the extension is built
// against torch (the team whose size `torch.set_num_threads` and `--threads` set).
#pragma once

#include <ATen/Parallel.h>

#include <cstdint>

namespace sparsespec {

inline int num_threads() { return at::get_num_threads(); }

// f(begin, end) over [begin, end) split across the team in ranges of at least `grain` items (one range, on the
// calling thread, when the work is below `grain` or the team has one thread).
template <class F>
void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
  at::parallel_for(begin, end, grain, f);
}

}  // namespace sparsespec
