// Query boundary: shared argument checks of the CPU and CUDA kernels.
#pragma once

#include "sdcp.h"

#include <optional>

namespace sdcp {

struct QueryShape {
  int64_t rows, heads, nope, rope;
  int64_t width() const { return nope + rope; }
};

QueryShape check_query_inputs(const at::Tensor& ql_nope, const at::Tensor& q_pe,
                              const at::Tensor& positions, const at::Tensor& cos_sin_cache,
                              const std::optional<at::Tensor>& q_scale, at::ScalarType out_dtype);

// Checks a query workspace against the inputs.
void check_query_workspace(const Workspace& ws, const QueryShape& s, at::ScalarType out_dtype);

// Checks that `inbox` is a view of this rank's inbox in `ws` (query_release).
void check_query_inbox(const Workspace& ws, const at::Tensor& inbox);

// This rank's inbox in `ws`.
inline uint8_t* local_inbox(const Workspace& ws) {
  return ws.slot_data(ws.rank, 0) + ws.layout.part_offset[0];
}

}  // namespace sdcp
