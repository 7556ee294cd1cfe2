"""bench/kernels/cutlass/peer.py: the CUTLASS dgrad problem of a transposed convolution, the configuration table, header
discovery (CPU), and the kernels' numerics against float64 PyTorch (GPU, with the CUTLASS headers)."""

from __future__ import annotations

import random
import re
import zipfile
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from bench.kernels.cutlass import build, peer

HERE = Path(peer.__file__).resolve().parent


def random_case(rng: random.Random) -> dict:
    k = (rng.randint(1, 9), rng.randint(1, 9))
    s = (rng.randint(1, 4), rng.randint(1, 4))
    p = (rng.randint(0, k[0] - 1), rng.randint(0, k[1] - 1))
    op = (rng.randint(0, s[0] - 1), rng.randint(0, s[1] - 1))
    return {"x": (rng.randint(1, 4), rng.randint(1, 40), rng.randint(1, 30), rng.randint(1, 30)),
            "c_out": rng.randint(1, 40), "k": k, "s": s, "p": p, "op": op}


def cases(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    out = []
    while len(out) < n:
        c = random_case(rng)
        h, w = c["x"][2:]
        ho = (h - 1) * c["s"][0] - 2 * c["p"][0] + c["k"][0] + c["op"][0]
        wo = (w - 1) * c["s"][1] - 2 * c["p"][1] + c["k"][1] + c["op"][1]
        if ho >= 1 and wo >= 1:
            out.append(c)
    return out


def test_problem_sizes_are_consistent_for_random_shapes() -> None:
    for c in cases(500):
        n, ci, h, w = c["x"]
        x = torch.empty(c["x"], device="meta")
        wt = torch.empty((ci, c["c_out"], *c["k"]), device="meta")
        y = F.conv_transpose2d(x, wt, None, c["s"], c["p"], c["op"])
        pr = peer.dgrad_problem(x.shape, wt.shape, c["s"], c["p"], c["op"])
        # y is the dgrad result [N, H, W, C]; x is the output gradient [N, P, Q, K]; the filter is [K, R, S, C].
        assert tuple(y.shape) == (pr.N, pr.C, pr.H, pr.W), c
        assert (n, ci, h, w) == (pr.N, pr.K, pr.P, pr.Q), c
        assert tuple(wt.permute(0, 2, 3, 1).shape) == (pr.K, pr.R, pr.S, pr.C), c
        assert (pr.pad_h, pr.pad_w, pr.stride_h, pr.stride_w, pr.dilation_h, pr.dilation_w) == (*c["p"], *c["s"], 1, 1)
        # The forward convolution (input H x W, filter R x S) gives back P x Q: what CUTLASS's dgrad iterates.
        assert peer.conv_out_size(pr.H, pr.R, pr.stride_h, pr.pad_h, 1) == pr.P, c
        assert peer.conv_out_size(pr.W, pr.S, pr.stride_w, pr.pad_w, 1) == pr.Q, c
        assert len(pr.as_list()) == 15
        # Zero-padded channels keep the spatial problem.
        pp = peer.padded(pr, 8)
        assert pp.C % 8 == 0
        assert pp.K % 8 == 0
        assert pp.C >= pr.C
        assert pp.K >= pr.K
        assert pp.as_list()[1:3] == pr.as_list()[1:3]
        assert pp.as_list()[5:] == pr.as_list()[5:]


def krsc_dgrad(dy: torch.Tensor, filt: torch.Tensor, pr: peer.DgradProblem) -> torch.Tensor:
    """CUTLASS's dgrad by its definition (cross-correlation): dx[n, h, w, c] = sum over k, r, s and the (p, q)
    with h = p * stride_h - pad_h + r * dilation_h, w likewise, of dy[n, p, q, k] * filt[k, r, s, c]."""
    dx = torch.zeros(pr.N, pr.H, pr.W, pr.C, dtype=dy.dtype)
    for r in range(pr.R):
        for s in range(pr.S):
            for p in range(pr.P):
                for q in range(pr.Q):
                    h = p * pr.stride_h - pr.pad_h + r * pr.dilation_h
                    w = q * pr.stride_w - pr.pad_w + s * pr.dilation_w
                    if 0 <= h < pr.H and 0 <= w < pr.W:
                        dx[:, h, w, :] += dy[:, p, q, :] @ filt[:, r, s, :]
    return dx


@pytest.mark.parametrize(("x_shape", "c_out", "k", "s", "p", "op"), [
    ((2, 3, 4, 5), 2, (4, 4), (2, 2), (1, 1), (0, 0)),
    ((1, 2, 3, 3), 3, (3, 3), (2, 2), (1, 1), (1, 1)),
    ((1, 2, 3, 4), 2, (2, 3), (2, 1), (0, 1), (1, 0)),
    ((2, 2, 2, 2), 1, (1, 1), (3, 2), (0, 0), (2, 1)),
])
def test_the_mapping_computes_conv_transpose2d(x_shape, c_out, k, s, p, op) -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(x_shape, generator=g, dtype=torch.float64)
    w = torch.randn((x_shape[1], c_out, *k), generator=g, dtype=torch.float64)
    pr = peer.dgrad_problem(x.shape, w.shape, s, p, op)
    dy = x.permute(0, 2, 3, 1)  # NHWC: what a channels_last x holds in memory
    filt = w.permute(0, 2, 3, 1)  # KRSC: what a channels_last w holds in memory
    assert w.contiguous(memory_format=torch.channels_last).permute(0, 2, 3, 1).is_contiguous()
    y = krsc_dgrad(dy, filt, pr).permute(0, 3, 1, 2)
    torch.testing.assert_close(y, F.conv_transpose2d(x, w, None, s, p, op), rtol=1e-12, atol=1e-12)


def test_problems_the_peer_refuses() -> None:
    with pytest.raises(peer.UnsupportedError, match="groups"):
        peer.dgrad_problem((1, 4, 5, 5), (4, 2, 3, 3), 2, 1, 0, 1, groups=2)
    # PyTorch allows output_padding >= stride when dilation is larger; the dgrad's forward size does not match.
    F.conv_transpose2d(torch.empty(1, 2, 5, 5, device="meta"), torch.empty(2, 2, 3, 3, device="meta"), None, 1, 0,
                       1, 1, 2)
    with pytest.raises(peer.UnsupportedError, match="forward convolution"):
        peer.dgrad_problem((1, 2, 5, 5), (2, 2, 3, 3), 1, 0, 1, 2)
    with pytest.raises(ValueError, match="output_padding"):
        peer.dgrad_problem((1, 2, 5, 5), (2, 2, 3, 3), 2, 0, 2)
    with pytest.raises(ValueError, match="input channels"):
        peer.dgrad_problem((1, 3, 5, 5), (2, 2, 3, 3))
    with pytest.raises(peer.UnsupportedError, match="float64"):
        peer.configs(torch.float64)


def entries_in_sources() -> list[tuple[str, str, int]]:
    found = []
    for dtype in ("bf16", "fp16", "tf32"):
        text = (HERE / f"dgrad_{dtype}.cu").read_text()
        for name, dt, align in re.findall(r'DECONV_CUTLASS_ENTRY\("([^"]+)", "([^"]+)", (\d+),', text):
            found.append((name, dt, int(align)))
    return found


def test_config_table_matches_the_kernel_sources() -> None:
    assert entries_in_sources() == list(peer.CONFIGS)
    for dtype in ("bf16", "fp16", "tf32"):
        names = peer.configs(dtype)
        assert all(n.startswith(dtype + "_") for n in names)
        assert peer.configs(peer.DTYPES[dtype]) == names
        assert all(n.endswith(f"_a{peer.alignment(n)}") for n in names)  # the name states the alignment
    # Aligned kernels first; tf32's alignment-1 fallback last. 16-bit has none (its two-stage kernel was wrong on
    # every shape on the GPU): other channel counts run on zero-padded channels.
    assert [peer.alignment(n) for n in peer.configs("bf16")] == [8, 8, 8]
    assert [peer.alignment(n) for n in peer.configs("fp16")] == [8, 8, 8]
    assert [peer.alignment(n) for n in peer.configs("tf32")] == [4, 4, 4, 1]


def test_unaligned_16_bit_channels_are_offered_on_padded_channels() -> None:
    x = torch.empty(2, 21, 7, 7, dtype=torch.bfloat16, device="meta")
    w = torch.empty(21, 21, 4, 4, dtype=torch.bfloat16, device="meta")
    problem = peer.dgrad_problem(x.shape, w.shape, 2)
    padded = peer.padded(problem, 8)
    assert (padded.K, padded.C) == (24, 24)
    assert "pad:bf16_128x128x32_w64x64_s3_opt_a8" in peer._hint(problem, "bf16_128x128x32_w64x64_s3_opt_a8", "x")
    assert "_a1" not in peer._hint(problem, "bf16_128x128x32_w64x64_s3_opt_a8", "x")
    assert "tf32_64x64x16_w32x32_s3_ana_a1" in peer._hint(problem, "tf32_128x128x16_w64x64_s4_opt_a4", "x")


def hide_installed(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    real = build.importlib.util.find_spec
    monkeypatch.setattr(build.importlib.util, "find_spec",
                        lambda name, *a: None if name == "cutlass_library" else real(name, *a))
    monkeypatch.setenv("DECONV_CUTLASS_WHEEL", str(tmp_path / "absent.whl"))
    monkeypatch.setenv("DECONV_CUTLASS_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("DECONV_CUTLASS_INCLUDE", raising=False)


def test_header_discovery_says_where_it_looked(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    hide_installed(monkeypatch, tmp_path)
    monkeypatch.setenv("DECONV_CUTLASS_INCLUDE", str(tmp_path))
    with pytest.raises(build.CutlassNotFoundError) as info:
        build.find_headers()
    text = str(info.value)
    assert "DECONV_CUTLASS_INCLUDE" in text
    assert "cutlass_library" in text
    assert "absent.whl" in text


VERSION_H = "#define CUTLASS_MAJOR 4\n#define CUTLASS_MINOR 2\n#define CUTLASS_PATCH 0\n"


def fake_package(root: Path) -> Path:
    inc = root / "cutlass_library" / "source" / "include" / "cutlass"
    inc.mkdir(parents=True)
    (inc / "cutlass.h").write_text("// cutlass\n")
    (inc / "version.h").write_text(VERSION_H)
    (root / "cutlass_library" / "source" / "tools" / "util" / "include" / "cutlass" / "util").mkdir(parents=True)
    return inc.parent


def test_header_discovery_from_a_directory(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    hide_installed(monkeypatch, tmp_path)
    include = fake_package(tmp_path / "site")
    for given in (tmp_path / "site", tmp_path / "site" / "cutlass_library", include):
        monkeypatch.setenv("DECONV_CUTLASS_INCLUDE", str(given))
        h = build.find_headers()
        assert h.include == include
        assert h.version == "4.2.0"
    assert build.find_headers().util_include is None  # the include directory itself names no util directory
    monkeypatch.setenv("DECONV_CUTLASS_INCLUDE", str(tmp_path / "site"))
    assert build.find_headers().util_include == tmp_path / "site/cutlass_library/source/tools/util/include"


def test_header_discovery_from_a_wheel(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    hide_installed(monkeypatch, tmp_path)
    wheel = tmp_path / "nvidia_cutlass-4.2.0.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("cutlass_library/source/include/cutlass/cutlass.h", "// cutlass\n")
        z.writestr("cutlass_library/source/include/cutlass/version.h", VERSION_H)
        z.writestr("cutlass_library/generator.py", "")
    monkeypatch.setenv("DECONV_CUTLASS_WHEEL", str(wheel))
    h = build.find_headers()
    assert h.version == "4.2.0"
    assert (h.include / "cutlass" / "cutlass.h").is_file()
    assert h.include.is_relative_to(tmp_path / "cache")
    assert not list((tmp_path / "cache").rglob("generator.py"))  # only the header trees are extracted


def real_wheel() -> Path | None:
    env = Path(build.os.environ.get("DECONV_CUTLASS_WHEEL", "/nonexistent"))
    wheels = [env] if env.is_file() else sorted((build.REPO_ROOT / ".whl").glob("nvidia_cutlass-*.whl"))
    return wheels[-1] if wheels else None


@pytest.mark.skipif(real_wheel() is None, reason="no nvidia_cutlass wheel in DECONV_CUTLASS_WHEEL or .whl/")
def test_the_real_wheel_holds_every_header_the_kernels_include(tmp_path: Path) -> None:
    wheel = real_wheel()
    assert wheel is not None
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
    for src in ("dgrad.cuh", "dgrad.cu"):
        for inc in re.findall(r'#include "(cutlass/[^"]+)"', (HERE / src).read_text()):
            assert f"cutlass_library/source/include/{inc}" in names, inc


@pytest.mark.cuda
@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["bf16", "fp16", "tf32"])
def test_cutlass_peer_numerics(dtype: str) -> None:
    if not peer.available():
        pytest.skip("CUTLASS headers not found or GPU older than sm_80 (see bench/kernels/cutlass/peer.py)")
    rows = peer.check(dtype)
    wrong = [r for r in rows if r["ran"] and not r["ok"]]
    assert not wrong, wrong
    # Every shape ran on at least one configuration: tf32's alignment-1 one on all of them, 16-bit odd channel
    # counts on padded channels.
    for shape in {r["shape"] for r in rows}:
        assert any(r["ran"] for r in rows if r["shape"] == shape), shape
    a1 = [c for c in peer.configs(dtype) if c.endswith("_a1")]
    assert all(r["ran"] for r in rows if r["config"] in a1), [r for r in rows if r["config"] in a1]
