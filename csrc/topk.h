// Top-K boundary: shared argument checks of the CPU and CUDA kernels.
#pragma once

#include "sdcp.h"

namespace sdcp {

// Checks scores [T, C] fp32 / ids [T, C] int32 (unit stride in the last
// dimension) and k >= 1.
void check_topk_inputs(const at::Tensor& scores, const at::Tensor& ids, int64_t k);

void check_topk_workspace(const Workspace& ws, const at::Tensor& scores, int64_t k);

}  // namespace sdcp
