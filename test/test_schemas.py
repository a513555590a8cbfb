"""Every sdcp schema, pinned. A schema change is an API change: update this
file on purpose (EXPECTTEST_ACCEPT=1) and say so in the commit."""

import expecttest
import torch

import torch_sdcp  # noqa: F401


def all_schemas() -> str:
    return "\n".join(sorted(str(s) for s in torch._C._jit_get_all_schemas() if s.name.startswith("sdcp::")))


class TestSchemas(expecttest.TestCase):
    def test_every_schema(self):
        self.assertExpectedInline(all_schemas(), """\
sdcp::lse_combine(Tensor partial_out, Tensor partial_lse, bool base2) -> (Tensor, Tensor)
sdcp::lse_correct(Tensor partial_out, Tensor gathered_lse, int rank, bool base2) -> (Tensor, Tensor)
sdcp::output_lse_combine(Tensor partial_out, Tensor partial_lse, int workspace, bool base2, Tensor? seq_lens=None, Tensor? query_start_loc=None, int tag=-1) -> (Tensor, Tensor)
sdcp::output_lse_combine_out(Tensor partial_out, Tensor partial_lse, int workspace, bool base2, Tensor(a!) out, Tensor(b!) out_lse, Tensor? seq_lens=None, Tensor? query_start_loc=None, int tag=-1) -> ()
sdcp::peer_all_gather(Tensor x, int workspace, int tag=-1) -> Tensor
sdcp::query_all_gather_heads(Tensor q, int workspace, int tag=-1) -> Tensor
sdcp::query_all_gather_heads_out(Tensor q, int workspace, Tensor(a!) out, int tag=-1) -> ()
sdcp::query_gather(Tensor ql_nope, Tensor q_pe, Tensor positions, Tensor cos_sin_cache, Tensor? q_scale, int workspace, bool neox, ScalarType out_dtype, int tag=-1) -> Tensor
sdcp::query_publish(Tensor ql_nope, Tensor q_pe, Tensor positions, Tensor cos_sin_cache, Tensor? q_scale, int workspace, bool neox, ScalarType out_dtype, int tag=-1) -> ()
sdcp::query_release(Tensor inbox, int workspace) -> ()
sdcp::query_rope_quant(Tensor ql_nope, Tensor q_pe, Tensor positions, Tensor cos_sin_cache, Tensor? q_scale, bool neox, ScalarType out_dtype) -> Tensor
sdcp::topk_merge(Tensor scores, Tensor ids, int workspace, int k, int tag=-1) -> Tensor
sdcp::topk_select(Tensor scores, Tensor ids, int k) -> Tensor
sdcp::workspace_abort(int handle) -> ()
sdcp::workspace_check(int handle) -> ()
sdcp::workspace_handles() -> int[]
sdcp::workspace_layout(int kind, int[] params, int world_size) -> int[]
sdcp::workspace_nbytes(int kind, int[] params, int world_size) -> int
sdcp::workspace_peer_headers(int handle, bool view) -> int[]
sdcp::workspace_register(int handle, int kind, int[] params, int base, int stride, int rank, int world_size, Device device, int timeout_ns) -> ()
sdcp::workspace_take_void(int handle) -> int
sdcp::workspace_unregister(int handle) -> ()
sdcp::workspace_void_address(int handle) -> int
sdcp::workspace_void_next(int handle, bool on) -> ()""")

    def test_every_peer_op_is_kept_by_the_compiler(self):
        # An op whose schema takes `int workspace` stores into peers' memory: a
        # peer op missing from PEER_OPS can be dropped as dead code when the
        # caller does not use its result on this rank.
        from torch_sdcp.fake import PEER_OPS

        peer_ops = sorted(s.name for s in torch._C._jit_get_all_schemas()
                          if s.name.startswith("sdcp::")
                          and any(a.name == "workspace" and str(a.type) == "int" for a in s.arguments))
        self.assertTrue(peer_ops, "no sdcp op takes `int workspace`")
        self.assertEqual(peer_ops, sorted(op._schema.name for op in PEER_OPS))
        for op in PEER_OPS:
            self.assertIn(op, torch.fx.node._side_effectful_functions, op._schema.name)
