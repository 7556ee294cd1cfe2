"""GPU checks of measured kernel choice (kernels.tuning): every kept kernel computes the function, choices are
cached per problem, and the serving entry points run a given choice (run with ``pytest -m cuda``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import kernels
import kernels.op
from kernels import tuning
from kernels.internal import forward_cuda, load_extension, normalize_args, output_size
from kernels.tuning import DEFAULT, KernelChoice, Tuner
from service.engine.ops import WeightPacks, conv_transpose2d_gathered
from tests.kernels.test_cuda import MODES, reference
from tests.numerics import rel_err

pytestmark = pytest.mark.cuda

# A dense layer where several tiles and splits compete, a narrow one, a grouped/dilated/strided odd one, and a
# problem whose rows are not 16-byte aligned (W = 37 floats).
PROBLEMS = {
    "dcgan_up1_b8": dict(n=8, c_in=128, c_out=64, h=32, w=32, k=(4, 4), stride=2, padding=1),
    "narrow": dict(n=2, c_in=16, c_out=3, h=17, w=33, k=(4, 4), stride=2, padding=1),
    "odd_groups": dict(n=3, c_in=24, c_out=40, h=9, w=37, k=(3, 5), stride=(2, 1), padding=(1, 2),
                       dilation=(1, 2), groups=4),
    "unaligned": dict(n=2, c_in=32, c_out=48, h=12, w=37, k=(3, 3), stride=1, padding=1),
}


def make(n, c_in, c_out, h, w, k, mode, *, stride=1, padding=0, dilation=1, groups=1, seed=0):
    dtype, precision, tol = MODES[mode]
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(n, c_in, h, w, device="cuda", generator=g).to(dtype)
    wt = torch.randn(c_in, c_out // groups, *k, device="cuda", generator=g).to(dtype)
    b = torch.randn(c_out, device="cuda", generator=g).to(dtype)
    args = normalize_args(stride, padding, 0, groups, dilation)
    return x, wt, b, args, precision or "fp32", tol


@pytest.mark.parametrize("mode", ["tf32", "fp32", "bf16"])
@pytest.mark.parametrize("name", list(PROBLEMS))
def test_tuned_choice_is_correct_and_cached(name: str, mode: str) -> None:
    x, wt, b, args, precision, tol = make(**PROBLEMS[name], mode=mode)
    tuner = Tuner(enabled=True)
    result = tuner.tune(x.shape, wt, b, args, precision)
    chosen = [t.choice for t in result.trials]
    assert DEFAULT in chosen
    assert result.choice in chosen
    assert result.ms <= result.default_ms
    for t in result.trials:
        assert t.diff is None or t.diff <= tuning.agree_tolerance(wt.dtype, precision), t
    assert tuner.lookup(Tuner.key(x.shape, wt, True, args, precision, True)) == result.choice
    assert tuner.choose(x.shape, wt, b, args, precision) == result.choice  # cached: no second tuning
    assert len(tuner) == 1

    # The kept kernel, run into a poisoned output on fresh inputs, computes the function.
    x2 = torch.randn_like(x, dtype=torch.float32).to(x.dtype)
    ho = output_size(x.shape[2], wt.shape[2], args.stride[0], args.padding[0], 0, args.dilation[0])
    wo = output_size(x.shape[3], wt.shape[3], args.stride[1], args.padding[1], 0, args.dilation[1])
    out = torch.full((x.shape[0], wt.shape[1] * args.groups, ho, wo), float("nan"), device="cuda", dtype=x.dtype)
    c = result.choice
    forward_cuda(x2, wt, b, args, precision, out=out, force_path=c.path, force_config=c.config, force_split=c.split)
    ref = reference(x2, wt, b, stride=args.stride, padding=args.padding, groups=args.groups, dilation=args.dilation)
    assert rel_err(out, ref) <= tol, f"{name}/{mode}: {c.label}"


def test_unaligned_rows_are_their_own_problem() -> None:
    x, wt, b, args, precision, _ = make(**PROBLEMS["unaligned"], mode="tf32")
    tuner = Tuner(enabled=True)
    tuner.tune(x.shape, wt, b, args, precision, aligned=True)
    tuner.tune(x.shape, wt, b, args, precision, aligned=False)
    assert len(tuner) == 2


def test_public_api_tunes_once_per_problem(monkeypatch: pytest.MonkeyPatch) -> None:
    x, wt, b, _, _, tol = make(**PROBLEMS["dcgan_up1_b8"], mode="tf32")
    tuner = Tuner(enabled=True)
    calls = []
    real_tune = tuner.tune

    def counting(*a, **kw):
        calls.append(a[0])
        return real_tune(*a, **kw)

    monkeypatch.setattr(tuner, "tune", counting)
    monkeypatch.setattr(tuning, "TUNER", tuner)
    monkeypatch.setattr(kernels.op, "TUNER", tuner)
    ref = reference(x, wt, b, stride=2, padding=1)
    for _ in range(3):
        y = kernels.conv_transpose2d(x, wt, b, stride=2, padding=1, precision="tf32")
        assert rel_err(y, ref) <= tol
    assert len(calls) == 1
    # Another batch size is another problem; the autograd path uses the same choice.
    kernels.conv_transpose2d(x[:3], wt, b, stride=2, padding=1, precision="tf32")
    assert len(calls) == 2
    xg = x.detach().clone().requires_grad_()
    y = kernels.conv_transpose2d(xg, wt, b, stride=2, padding=1, precision="tf32")
    y.sum().backward()
    assert len(calls) == 2
    assert xg.grad is not None


@pytest.mark.parametrize("choice", [DEFAULT, KernelChoice("tensor_core", 9), KernelChoice("tensor_core", 5, 4),
                                    KernelChoice("simt")])
def test_gathered_runs_a_given_choice(choice: KernelChoice) -> None:
    x, wt, b, args, precision, tol = make(**PROBLEMS["dcgan_up1_b8"], mode="tf32")
    host = x.cpu()
    y = conv_transpose2d_gathered([host[:3], host[3:]], host.shape, wt, b, args, precision, choice)
    ref = reference(x, wt, b, stride=2, padding=1)
    assert rel_err(y.cuda(), ref) <= tol, choice.label


# --- packed weights kept with a layer (WeightPacks) -------------------------------------------------------------


@pytest.mark.parametrize("mode", ["tf32", "fp32", "bf16", "fp16"])
def test_weight_packs_give_what_per_call_packing_gives(mode: str) -> None:
    """Every tensor-core tile (gather, mma.sync halo, wgmma halo, split) and the other families, with the weights
    packed once and kept, computes bit for bit what the same kernel computes packing per call."""
    x, wt, b, args, precision, tol = make(**PROBLEMS["dcgan_up1_b8"], mode=mode)
    packs = WeightPacks(wt)
    choices = [DEFAULT, KernelChoice("narrow"), KernelChoice("simt"), KernelChoice("tensor_core", 5, 4),
               *(KernelChoice("tensor_core", c) for c in range(int(load_extension().num_tensor_core_configs)))]
    ref = reference(x, wt, b, stride=2, padding=1)
    for c in choices:
        kw = dict(force_path=c.path, force_config=c.config, force_split=c.split)
        plain, path = forward_cuda(x, wt, b, args, precision, **kw)
        out = torch.full_like(plain, float("nan"))
        packed, path_packed = forward_cuda(x, wt, b, args, precision, out=out, packs=packs, **kw)
        assert path == path_packed
        assert torch.equal(plain, packed), c.label
        assert rel_err(packed, ref) <= tol, c.label
    made = len(packs)
    assert made >= 2  # the gather tiles and the halo tiles pack differently
    for c in choices:  # every layout is there now: nothing new is made
        forward_cuda(x, wt, b, args, precision, force_path=c.path, force_config=c.config, packs=packs)
    assert len(packs) == made


def test_weight_packs_refuse_another_weight() -> None:
    x, wt, b, args, precision, _ = make(**PROBLEMS["dcgan_up1_b8"], mode="tf32")
    packs = WeightPacks(wt)
    with pytest.raises(kernels.ConvTranspose2dArgumentError, match="another weight"):
        forward_cuda(x, wt.clone(), b, args, precision, packs=packs)
    with pytest.raises(kernels.ConvTranspose2dArgumentError, match="contiguous 4-D CUDA"):
        WeightPacks(wt.cpu())


def test_gathered_with_packs_and_a_tuner_that_measured_with_them() -> None:
    x, wt, b, args, precision, tol = make(**PROBLEMS["dcgan_up1_b8"], mode="tf32")
    packs = WeightPacks(wt)
    tuner = Tuner(enabled=True)
    choice = tuner.choose(x.shape, wt, b, args, precision, packs=packs)
    assert len(packs) >= 1
    assert tuner.lookup(Tuner.key(x.shape, wt, True, args, precision, True, True)) == choice
    assert tuner.lookup(Tuner.key(x.shape, wt, True, args, precision, True, False)) is None
    host = x.cpu()
    y = conv_transpose2d_gathered([host[:5], host[5:]], host.shape, wt, b, args, precision, choice, packs)
    assert rel_err(y.cuda(), reference(x, wt, b, stride=2, padding=1)) <= tol


def test_a_choice_measured_once_is_recalled_from_disk(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A problem measured by one tuner is written to its GPU's choice file (kernels.choice_store); a new tuner (a
    later process) recalls it without measuring, and the recalled kernel computes the function."""
    monkeypatch.setenv("DECONV_TUNE_CACHE", str(tmp_path))
    x, wt, b, args, precision, tol = make(**PROBLEMS["dcgan_up1_b8"], mode="bf16")
    first = Tuner(enabled=True)
    choice = first.choose(x.shape, wt, b, args, precision)
    files = list(tmp_path.glob("*.json"))
    assert len(files) == 1, files
    assert torch.cuda.get_device_name(0).split()[0] in files[0].name

    later = Tuner(enabled=True)
    monkeypatch.setattr(later, "tune", lambda *a, **k: pytest.fail("a recalled problem must not be measured"))
    assert later.choose(x.shape, wt, b, args, precision) == choice
    y, _ = forward_cuda(x, wt, b, args, precision, force_path=choice.path, force_config=choice.config,
                        force_split=choice.split, force_staged=choice.staged, force_round=choice.rounded)
    ref = reference(x, wt, b, stride=args.stride, padding=args.padding, groups=args.groups, dilation=args.dilation)
    assert rel_err(y, ref) <= tol
