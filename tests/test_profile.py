"""jaxllmq.profile: kernel time by category from an XSpace trace, and the bench's --profile_steps."""

import os

import pytest
from jax.profiler import ProfileData

from jaxllmq import profile

# Two steps of a fake GPU trace: a gemm of 3 ms and a fusion of 1 ms per step on the compute
# stream, NCCL kernels of 2.75 ms per step on another (1 ms of the second runs while the compute
# stream is idle), 0.5 ms with nothing running before the last fusion, and an "XLA Ops" line that
# repeats them.
TRACE = """
planes {
  id: 1
  name: "/device:GPU:0"
  lines { id: 1 name: "Stream #13(Compute)" timestamp_ns: 0
    events { metadata_id: 1 offset_ps: 0 duration_ps: 3000000000 }
    events { metadata_id: 2 offset_ps: 3000000000 duration_ps: 1000000000 }
    events { metadata_id: 1 offset_ps: 5000000000 duration_ps: 3000000000 }
    events { metadata_id: 2 offset_ps: 8500000000 duration_ps: 1000000000 }
  }
  lines { id: 2 name: "Stream #20(MemcpyP2P)" timestamp_ns: 0
    events { metadata_id: 3 offset_ps: 0 duration_ps: 4000000000 }
    events { metadata_id: 3 offset_ps: 4000000000 duration_ps: 1500000000
             stats { metadata_id: 9 str_value: "reduce-scatter-start.2" } }
  }
  lines { id: 3 name: "XLA Ops" timestamp_ns: 0
    events { metadata_id: 4 offset_ps: 0 duration_ps: 9000000000 }
  }
  event_metadata { key: 1 value { id: 1 name: "nvjet_tst_128x256_64x4_1x2_h_bz_coopB_TNT" } }
  event_metadata { key: 2 value { id: 2 name: "loop_multiply_fusion_3" } }
  event_metadata { key: 3 value { id: 3 name: "ncclDevKernel_ReduceScatter_Sum_f32" } }
  event_metadata { key: 4 value { id: 4 name: "dot.12" } }
  stat_metadata { key: 9 value { id: 9 name: "hlo_op" } }
}
planes { id: 2 name: "/host:CPU" }
"""


def test_categories_of_real_kernel_names():
    assert profile.category("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize") == "gemm"
    assert profile.category("cudnn_generated_fort_native_sdpa_sm90_flash_fprop") == "attention"
    assert profile.category("ncclDevKernel_AllGather_RING_LL") == "nccl"
    assert profile.category("input_reduce_fusion_7") == "fusion"
    assert profile.category("something_else") == "other"


def test_breakdown_sums_stream_kernels_per_step(tmp_path):
    path = tmp_path / "run" / "host.xplane.pb"
    os.makedirs(path.parent)
    path.write_bytes(ProfileData.text_proto_to_serialized_xspace(TRACE))
    out = profile.breakdown(str(tmp_path), steps=2)
    assert out["categories"] == {"gemm": 3.0, "nccl": 2.75, "fusion": 1.0}
    assert out["device_ms_per_step"] == 6.75
    assert out["exposed_nccl_ms_per_step"] == 0.5
    name = "ncclDevKernel_ReduceScatter_Sum_f32 [reduce-scatter-start.2]"  # the op, from its stat
    assert out["exposed_nccl_kernels"] == [(name, 0.5)]
    assert out["idle_ms_per_step"] == 0.25
    assert out["idle_before_kernels"] == [("loop_multiply_fusion_3", 0.25)]
    name, ms, count = out["kernels"][0]
    assert name.startswith("nvjet") and ms == 3.0 and count == 1
    assert "dot.12" not in {k for k, _, _ in out["kernels"]}  # the XLA Ops line is not counted
    assert "gemm" in profile.format_breakdown(out)


# Two launches (two steps) of one cuBLAS GEMM of the train step, whose rhs is a tuple element,
# and one launch of an op of the same name in another module, which must not count.
GEMM_TRACE = """
planes {
  id: 1
  name: "/device:GPU:0"
  lines { id: 1 name: "Stream #13(Compute)" timestamp_ns: 0
    events { metadata_id: 1 offset_ps: 0 duration_ps: 2000000
             stats { metadata_id: 9 str_value: "custom-call.5" }
             stats { metadata_id: 8 str_value: "jit_train_step" } }
    events { metadata_id: 1 offset_ps: 5000000 duration_ps: 4000000
             stats { metadata_id: 9 str_value: "custom-call.5" }
             stats { metadata_id: 8 str_value: "jit_train_step" } }
    events { metadata_id: 1 offset_ps: 9000000 duration_ps: 90000000
             stats { metadata_id: 9 str_value: "custom-call.5" }
             stats { metadata_id: 8 str_value: "jit_matmul" } }
  }
  event_metadata { key: 1 value { id: 1 name: "nvjet_sm90_tst_128x256_64x4_2x1_v_bz_NNT" } }
  stat_metadata { key: 9 value { id: 9 name: "hlo_op" } }
  stat_metadata { key: 8 value { id: 8 name: "hlo_module" } }
}
"""
HLO = """
  %p0 = bf16[64,32]{1,0} parameter(0)
  %fusion.1 = (f32[16]{0}, bf16[32,16]{1,0}) fusion(%p0), kind=kLoop, calls=%fused
  ROOT %custom-call.5 = (bf16[64,16]{1,0}, s8[1024]{0}) custom-call(%p0, %fusion.1#1), custom_call_target="__cublas$lt$matmul", backend_config={"gemm_backend_config":{"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["0"]}}}
"""


def test_op_table_joins_kernels_to_their_ops_shapes(tmp_path):
    path = tmp_path / "run" / "host.xplane.pb"
    os.makedirs(path.parent)
    path.write_bytes(ProfileData.text_proto_to_serialized_xspace(GEMM_TRACE))
    (row,) = profile.op_table(str(tmp_path), HLO, module="jit_train_step")
    assert row["shape"] == "[64, 32] x [32, 16] -> [64, 16]"
    assert row["ops"] == 1 and row["kernel"].startswith("nvjet")
    assert row["ms"] == pytest.approx(3e-3)  # (2 + 4) us over two steps
    assert row["tflops"] == pytest.approx(2 * 64 * 32 * 16 / 3e-6 / 1e12)
    assert "TFLOP/s" in profile.format_op_table([row])
    # Another category: the op's result type and opcode, no TFLOP/s.
    copy = GEMM_TRACE.replace("nvjet_sm90_tst_128x256_64x4_2x1_v_bz_NNT", "MemcpyD2D")
    path.write_bytes(ProfileData.text_proto_to_serialized_xspace(copy))
    hlo = HLO.replace("custom-call(%p0, %fusion.1#1)", "copy(%p0)")
    (row,) = profile.op_table(str(tmp_path), hlo, module="jit_train_step", kind="copy")
    assert row["shape"].endswith(" copy") and row["tflops"] is None
