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

// Checks a query workspace against the inputs; returns the world size.
void check_query_workspace(const Workspace& ws, const QueryShape& s, at::ScalarType out_dtype);

}  // namespace sdcp
