"""benchmarks/ncu_summary.py on a made-up source page of ncu's: three launches of two kernels (and
one table ncu printed twice), each split into its loops by how often their instructions ran, with
the samples' shares and stall reasons."""

import json

import pytest

from benchmarks import ncu_summary

HEADER = (
    '"Address","Source","Warp Stall Sampling (All Samples)","Instructions Executed",'
    '"stall_barrier","stall_long_sb","stall_selected","stall_long_sb (Not Issued)"'
)
PAGE = "\n".join(
    [
        '"Kernel Name","dkv_mosaic_gpu_kernel",',
        HEADER,
        '"0x10","  HGMMA.64x64x16.F32.BF16 R24, gdesc[UR8], RZ","10","1,000","0","0","10","7"',
        '"0x20","  WARPGROUP.DEPBAR.LE gsb0, 0x0","50","1,000","45","0","5","0"',
        '"0x30","@!P2 BRA 0x7f00","30","500","0","30","0","30"',
        '"0x40","  EXIT","10","8","0","0","10","0"',
        '"Kernel Name","forward_mosaic_gpu_kernel",',
        HEADER,
        '"0x10","  MUFU.EX2 R1, R1","4","64","0","0","4","0"',
        '"Kernel Name","forward_mosaic_gpu_kernel",',  # ncu's repeat of a launch's table
        HEADER,
        '"0x10","  MUFU.EX2 R1, R1","4","64","0","0","4","0"',
        '"Kernel Name","forward_mosaic_gpu_kernel",',  # a second launch of that kernel
        HEADER,
        '"0x10","  MUFU.EX2 R1, R1","8","64","0","0","8","0"',
    ]
)


@pytest.fixture
def page(tmp_path):
    path = tmp_path / "source.csv"
    path.write_text(PAGE + "\n")
    return str(path)


def test_each_kernels_loops_are_its_instructions_that_ran_equally_often(page):
    launches = ncu_summary.read_source_page(page)
    names = ["dkv_mosaic_gpu_kernel"] + ["forward_mosaic_gpu_kernel"] * 2
    assert [name for name, _ in launches] == names  # the repeated table once
    assert [launches[n][1][0]["Warp Stall Sampling (All Samples)"] for n in (1, 2)] == ["4", "8"]
    summary = ncu_summary.summarize("dkv", launches[0][1], loops=2, hottest=1)
    assert summary["samples"] == 100 and summary["executed"] == 2508
    assert summary["loops"] == [
        {
            "runs": 1000,
            "instructions": 2,
            "executed": 2000,
            "samples_share": 0.6,
            "stalls": {"barrier": 0.75, "selected": 0.25},  # the not-issued column left out
        },
        {
            "runs": 500,
            "instructions": 1,
            "executed": 500,
            "samples_share": 0.3,
            "stalls": {"long_sb": 1.0},
        },
    ]
    assert summary["hottest"] == [
        {
            "sass": "WARPGROUP.DEPBAR.LE gsb0, 0x0",
            "runs": 1000,
            "samples_share": 0.5,
            "stalls": {"barrier": 0.9, "selected": 0.1},
        }
    ]


def test_it_prints_a_line_per_kernel_and_refuses_a_file_that_is_no_source_page(
    page, tmp_path, capsys
):
    ncu_summary.FLAGS(["ncu_summary"])
    try:
        ncu_summary.main(["ncu_summary", page])
        rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
        assert [(row["launch"], row["kernel"], row["samples"]) for row in rows] == [
            (0, "dkv_mosaic_gpu_kernel", 100),
            (1, "forward_mosaic_gpu_kernel", 4),
            (2, "forward_mosaic_gpu_kernel", 8),
        ]
        other = tmp_path / "details.csv"
        other.write_text('"ID","Kernel Name","Metric Name"\n"0","k","Duration"\n')
        with pytest.raises(SystemExit, match="no kernel in it; give ncu's source page"):
            ncu_summary.main(["ncu_summary", str(other)])
        report = tmp_path / "x.ncu-rep"
        report.write_bytes(bytes([0x4E, 0xD8, 0x00, 0xFF]) * 64)  # not text
        with pytest.raises(SystemExit, match="x.ncu-rep: not CSV text; give ncu's source page"):
            ncu_summary.main(["ncu_summary", str(report)])
        with pytest.raises(SystemExit, match="missing.csv: No such file"):
            ncu_summary.main(["ncu_summary", str(tmp_path / "missing.csv")])
    finally:
        ncu_summary.FLAGS.unparse_flags()
