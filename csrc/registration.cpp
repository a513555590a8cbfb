// Every schema of the sdcp library, in one place. Kernels are registered at the
// bottom of each family's source file (CPU in .cpp, CUDA in .cu); fake
// implementations live in torch_sdcp/fake.py.
//
// Rules (docs/DESIGN.md section 5): torch never sees peer memory as an argument.
// Peer ops take the caller's tensors plus an integer workspace handle, resolve
// it in C++, and return fresh tensors or write caller-owned outputs.

#include <Python.h>
#include <torch/library.h>

extern "C" {
// `import torch_sdcp._C` loads this shared object, which runs the static
// registrations below. There are no Python bindings.
PyObject* PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module_def);
}
}

TORCH_LIBRARY(sdcp, m) {
  // The fake implementations of the ops below live in this module: torch
  // imports it when a fake is needed and checks that register_fake was
  // called from it.
  m.set_python_module("torch_sdcp.fake");

  // ---- Local computations (also the collective path's kernels) ----------
  // RoPE on q_pe (interleaved/GPT-J or NeoX pairing), concatenation with
  // ql_nope, then bf16 or saturating float8_e4m3fn (x / q_scale).
  m.def("query_rope_quant(Tensor ql_nope, Tensor q_pe, Tensor positions, Tensor cos_sin_cache, "
        "Tensor? q_scale, bool neox, ScalarType out_dtype) -> Tensor");
  // Stable top-k over candidate pairs: score desc, lower id on ties, ids < 0
  // never selected, NaN below -inf, -0.0 == +0.0. Ids in selection order,
  // -1 padded.
  m.def("topk_select(Tensor scores, Tensor ids, int k) -> Tensor");
  // LSE-weighted combine of N stacked partial results [N, T, H, D] / [N, T, H].
  m.def("lse_combine(Tensor partial_out, Tensor partial_lse, bool base2) -> (Tensor, Tensor)");
  // The collective path's correction: gathered LSEs [N, T, H] fp32 and this
  // rank's partial [T, H, D] -> (w_rank * O head-major [H, T, D], global LSE [T, H]).
  m.def("lse_correct(Tensor partial_out, Tensor gathered_lse, int rank, bool base2) -> (Tensor, Tensor)");

  // ---- Peer boundaries (workspace handle, device-side signals) ----------
  // Every op that carries a call header takes `tag`, the caller's call tag
  // (-1: untagged, else [0, 2**23 - 1)), compared by every peer with its own.
  // Signalling primitive: store x into every rank's inbox, publish, wait for
  // every peer; returns the rank-major stack [N, *x.shape].
  m.def("peer_all_gather(Tensor x, int workspace, int tag=-1) -> Tensor");
  // Output/LSE: producer-direct publish of each destination's head shard and
  // LSE, owner-side combine. Returns ([T, H/N, D], [T, H/N] fp32). With
  // seq_lens [R] and query_start_loc [R + 1] (vLLM's metadata, local to each
  // rank), padding rows and rows of empty shards get no weight.
  m.def("output_lse_combine(Tensor partial_out, Tensor partial_lse, int workspace, bool base2, "
        "Tensor? seq_lens=None, Tensor? query_start_loc=None, int tag=-1) -> (Tensor, Tensor)");
  m.def("output_lse_combine_out(Tensor partial_out, Tensor partial_lse, int workspace, bool base2, "
        "Tensor(a!) out, Tensor(b!) out_lse, Tensor? seq_lens=None, Tensor? query_start_loc=None, int tag=-1) -> ()");
  // Top-K: each owner publishes its candidate shard in place; every consumer
  // selects over local and peer shards. Returns [T, k] int32 global ids.
  m.def("topk_merge(Tensor scores, Tensor ids, int workspace, int k, int tag=-1) -> Tensor");
  // Query: the fused producer stores its head shard into every peer's buffer
  // and its own heads into the result; returns the gathered [T, N*H_loc, 576].
  m.def("query_gather(Tensor ql_nope, Tensor q_pe, Tensor positions, Tensor cos_sin_cache, "
        "Tensor? q_scale, int workspace, bool neox, ScalarType out_dtype, int tag=-1) -> Tensor");
  // Query, zero-copy: produce, store and wait, leaving the gathered query in
  // this rank's view buffer for a reader that uses it in place;
  // query_release(inbox) (the view's first T rows) says the reader is done:
  // it re-fills them and no producer stores into them before it.
  m.def("query_publish(Tensor ql_nope, Tensor q_pe, Tensor positions, Tensor cos_sin_cache, "
        "Tensor? q_scale, int workspace, bool neox, ScalarType out_dtype, int tag=-1) -> ()");
  m.def("query_release(Tensor inbox, int workspace) -> ()");
  // Query, produced elsewhere: every rank's q [T, H_loc, W] (bf16, fp16, fp32,
  // float8_e4m3fn or float8_e5m2) gathered on heads into [T, N*H_loc, W], head
  // src*H_loc + h, through the same buffers (no RoPE).
  m.def("query_all_gather_heads(Tensor q, int workspace, int tag=-1) -> Tensor");
  m.def("query_all_gather_heads_out(Tensor q, int workspace, Tensor(a!) out, int tag=-1) -> ()");

  // ---- Workspace control (host side, never captured) --------------------
  m.def("workspace_nbytes(int kind, int[] params, int world_size) -> int");
  // [control_bytes, data_offset, slots, slot_bytes, region_bytes, part_values x 4]
  m.def("workspace_layout(int kind, int[] params, int world_size) -> int[]");
  m.def("workspace_register(int handle, int kind, int[] params, int base, int stride, int rank, "
        "int world_size, Device device, int timeout_ns) -> ()");
  m.def("workspace_unregister(int handle) -> ()");
  m.def("workspace_handles() -> int[]");
  // Raises when the workspace is poisoned on this rank (a timeout, a call
  // mismatch, a peer's abort); reads host memory only, so it is usable
  // between replays of a CUDA graph and never synchronises.
  m.def("workspace_check(int handle) -> ()");
  // A call raised after it was entered: poison the workspace on this rank and
  // store this rank's abort word into every rank's control region.
  m.def("workspace_abort(int handle) -> ()");
  // Void calls (docs/PROTOCOL.md): mark the headers of the placeholder call,
  // take the first void met (0: none), and the host address of that word.
  m.def("workspace_void_next(int handle, bool on) -> ()");
  m.def("workspace_take_void(int handle) -> int");
  m.def("workspace_void_address(int handle) -> int");
  // For a call over max_rows on this rank: the index of its next call (its
  // next view call with `view`), then the call headers its peers stored for
  // it, 4 words per rank, rank-major (0xFFFFFFFF: not landed, or this rank).
  // Synchronise the stream first on CUDA; never captured.
  m.def("workspace_peer_headers(int handle, bool view) -> int[]");
}
