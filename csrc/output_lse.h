// Output/LSE boundary: shared argument checks of the CPU and CUDA kernels.
#pragma once

#include "sdcp.h"

namespace sdcp {

constexpr int kMaxWorld = 64;

// partial_out [T, H, D] (bf16/fp16/fp32, packed) and partial_lse [T, H] fp32.
void check_partial_inputs(const at::Tensor& partial_out, const at::Tensor& partial_lse);

void check_output_lse_workspace(const Workspace& ws, const at::Tensor& partial_out);

// Caller-owned outputs of output_lse_combine_out.
void check_combine_outputs(const Workspace& ws, const at::Tensor& partial_out, const at::Tensor& out,
                           const at::Tensor& out_lse);

}  // namespace sdcp
