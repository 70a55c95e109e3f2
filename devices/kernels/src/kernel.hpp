// The MatMulNBits kernel object ONNX Runtime holds per node: B packed once at creation, then one call per run.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "onnxruntime_c_api.h"
#include "qgemm.hpp"

namespace mirrorsd_kern {

// The oldest ONNX Runtime API level this library needs (KernelContext_ParallelFor arrived in 1.17).
constexpr uint32_t kOrtApiVersion = 17;

// Inputs of com.microsoft::MatMulNBits, in order.
enum Input : size_t { kA = 0, kB = 1, kScales = 2, kZeroPoints = 3, kGroupIndex = 4, kBias = 5, kInputCount = 6 };

// The path for this process: the best one the CPU runs, or the one MIRRORSD_KERNELS_ISA names ("amx",
// "avx512vnni", "avx2", "scalar"). Returns null and says why when the requested path cannot run here.
const Path* select_path(std::string& why);

// Whether a node whose scales and zero points have Q4_K's form is packed in the path's super-block layout: yes,
// unless MIRRORSD_KERNELS_SUPERBLOCKS=0 (read when a session creates its kernels; for A/B measurements).
bool superblocks_wanted();
// MatMulNBits nodes packed in a super-block layout since the library was loaded (mirrorsd_kern_superblock_nodes).
size_t superblock_nodes();

// The fewest rows a tile of `path` has when it prefetches B ahead of the stream (Shape::prefetch_from; 0: no tile
// does; it never changes a result): MIRRORSD_KERNELS_PREFETCH when set to a number (read when a session creates its
// kernels: 0 none, 1 every tile, N tiles of N rows or more; anything else is ignored); else 1 (every tile), except
// the AVX-512 path on a CPU that is not Intel's: kAvx512PrefetchFromElsewhere. Measured on the Qwen pair: an Intel
// Xeon VM (Sapphire Rapids class) ran sd 7-10 % faster with the AVX-512 path's prefetch; on an AMD EPYC (Zen 4 class)
// that path ran ar 4-7 % and sd 3-5 % faster without it in every tile, and with it in tiles of 5 rows or more only,
// target forwards of 5-8 rows ran 4-18 % faster and of 1-4 rows as fast (tiles of 2-4 rows prefetching made their
// forwards 6-28 % slower there: docs/bench/epyc-2026-12-08/kernel-tiles.md); its AVX2 path ran sd 5-6 % faster with
// its own (docs/lab-notes/performance-log.md).
constexpr int kAvx512PrefetchFromElsewhere = 5;
int prefetch_wanted(const Path& path);

// A tensor's data, dimensions, element count and element type (read through the API).
struct TensorView {
  void* data = nullptr;
  std::vector<int64_t> dims;
  int64_t count = 0;
  ONNXTensorElementDataType type = ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;
};

struct ArenaDeleter {
  void operator()(uint8_t* p) const;
};

class Kernel {
 public:
  // Reads and checks the node's attributes and constant inputs, and packs B; an error status on any problem.
  static OrtStatus* create(const OrtApi* api, const OrtKernelInfo* info, Kernel** out);
  OrtStatus* compute(OrtKernelContext* context) const;

 private:
  Kernel(const OrtApi* api, std::string node) : api_(api), node_(std::move(node)) {}
  OrtStatus* error(OrtErrorCode code, const std::string& what, const std::string& fix) const;
  OrtStatus* read_attributes(const OrtKernelInfo* info);
  OrtStatus* check_optional_inputs(const OrtKernelInfo* info);
  OrtStatus* constant_input(const OrtKernelInfo* info, size_t index, const char* name, TensorView& out) const;
  OrtStatus* check_zero_points(const TensorView& zero_points) const;
  OrtStatus* pack_weights(const OrtKernelInfo* info);

  const OrtApi* api_;
  std::string node_;
  Shape shape_;
  const Path* path_ = nullptr;
  std::unique_ptr<uint8_t, ArenaDeleter> packed_;
  size_t packed_bytes_ = 0;
  bool superblocks_ = false;     // B packed in the path's super-block layout (find_superblocks accepted the node)
  int64_t groups_ = 0;           // column groups of the path's packed layout
  int64_t groups_per_task_ = 1;  // the unit of ParallelFor
};

// Shared by the library's kernels (kernel.cpp): a node's name for error messages ("" if ONNX Runtime gives none), and
// a shape as "[a, b, c]".
std::string node_name(const OrtApi* api, const OrtKernelInfo* info);
std::string shape_text(const std::vector<int64_t>& dims);

}  // namespace mirrorsd_kern
