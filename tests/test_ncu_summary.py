"""benchmarks.ncu_summary: an ncu raw-page CSV (header, units, a row per kernel) read into
per-kernel figures, units converted, stall reasons as shares of the sampled stalls."""
from __future__ import annotations

import pytest

from benchmarks import ncu_summary

CSV = '''==PROF== Connected to process 1
"ID","Kernel Name","gpu__time_duration.sum","dram__bytes_read.sum","launch__registers_per_thread","smsp__pcsamp_warps_issue_stalled_long_scoreboard","smsp__pcsamp_warps_issue_stalled_barrier","smsp__pcsamp_warps_issue_stalled_long_scoreboard_not_issued"
"","","nsecond","Mbyte","register/thread","","",""
"0","gemv_stream_add_norm","10,500","25.20","96","300","100","999"
"1","paged_decode_attention","4,400","1.30","128","0","0","0"
'''


def test_reads_kernels_units_and_stall_shares(tmp_path, capsys):
    path = tmp_path / "raw.csv"
    path.write_text(CSV)
    ks = ncu_summary.read(str(path))
    assert [k["name"] for k in ks] == ["gemv_stream_add_norm", "paged_decode_attention"]
    assert ks[0]["us"] == 10.5 and ks[0]["dram_read_MB"] == 25.2 and ks[0]["registers"] == 96
    assert "dram_MB" not in ks[0]  # reads alone are not the reads and writes
    # the _not_issued counter is not a reason of its own; shares of the reasons sampled
    assert ks[0]["stalls"] == {"long_scoreboard": 0.75, "barrier": 0.25}
    assert "stalls" not in ks[1]  # no samples
    assert ncu_summary.main([str(path), "--json", str(tmp_path / "s.json")]) == 0
    assert "long_scoreboard 75%" in capsys.readouterr().out
    import json
    saved = json.loads((tmp_path / "s.json").read_text())
    assert saved["source"] == str(path) and saved["kernels"] == ks


def test_reads_warp_state_averages_too(tmp_path):
    path = tmp_path / "raw.csv"
    path.write_text('"ID","Kernel Name",'
                    '"smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio",'
                    '"smsp__average_warps_issue_stalled_wait_per_issue_active.ratio"\n'
                    '"","","ratio","ratio"\n"0","k","1.5","0.5"\n')
    assert ncu_summary.read(str(path))[0]["stalls"] == {"barrier": 0.75, "wait": 0.25}


def test_a_full_report_uses_the_sampled_counts_only_and_a_bad_file_says_so(tmp_path):
    path = tmp_path / "raw.csv"
    path.write_text('"ID","Kernel Name","smsp__pcsamp_warps_issue_stalled_wait",'
                    '"smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio"\n'
                    '"","","","ratio"\n"0","k","10","7.5"\n')
    assert ncu_summary.read(str(path))[0]["stalls"] == {"wait": 1.0}
    path.write_text("==ERROR== no kernels were profiled\n")
    with pytest.raises(SystemExit, match="no ncu raw-page table"):
        ncu_summary.read(str(path))


def test_sections_without_byte_totals_give_bytes_from_the_rate(tmp_path):
    # SpeedOfLight alone (no --set full) reports the DRAM rate and the %-of-peak under the
    # gpu__ name, the duration in "us" (session 30's H100 report: qkv 25.36 MB); the bytes
    # are rate x duration, from the unrounded values
    path = tmp_path / "raw.csv"
    path.write_text('"ID","Kernel Name","gpu__time_duration.sum","dram__bytes.sum.per_second",'
                    '"gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed"\n'
                    '"","","us","Tbyte/s","%"\n"0","k","13.888","1.825917","54.64"\n'
                    '"1","j","2","500","10"\n"2","i","10","0.00149","1"\n')
    ks = ncu_summary.read(str(path))
    assert ks[0]["us"] == 13.888 and ks[0]["dram_TB_s"] == 1.826 and ks[0]["dram_pct"] == 54.64
    assert ks[0]["dram_MB"] == round(13.888 * 1.825917, 3)
    assert ks[2]["dram_TB_s"] == 0.001 and ks[2]["dram_MB"] == 0.015  # (not 10 x 0.001)
    path.write_text(path.read_text().replace("Tbyte/s", "Gbyte/s").replace('"us"', '"ns"'))
    ks = ncu_summary.read(str(path))
    assert ks[1]["us"] == 0.002 and ks[1]["dram_MB"] == pytest.approx(0.001)  # 0.5 TB/s x 2 ns
    path.write_text(path.read_text().replace('"ns"', '"fortnight"'))
    with pytest.raises(SystemExit, match="unit 'fortnight'"):
        ncu_summary.read(str(path))
