"""Sequence-parallel H3 on 2 and 4 gloo ranks (spawned processes) against one process.

Every sampling output (video and audio latents) of t2va, fl2va with keyframes, ref2va with references, a
noise-masked run, int8-convrot weights, a LoRA, VSA and a Fun ControlNet hook, and the decoded frames and
sound, must equal the single process's. The bound held is max |a - b| <= 1e-6 * max |b| per tensor (with
one compute thread per process, as here, the outputs are in fact bit-identical). Each rank count runs all
scenarios in one spawn of its ranks.
"""
from __future__ import annotations

import pytest
import torch

from tests.models.h3 import sp_ranks

RELATIVE_BOUND = 1e-6
SCENARIO_OUTPUTS = ["t2va/video", "t2va/audio", "t2va/frames", "t2va/sound", "decode/frames",
                    "fl2va/video", "fl2va/audio", "ref2va/video", "ref2va/audio", "masked/video", "masked/audio",
                    "int8/video", "int8/audio", "lora/video", "lora/audio", "vsa/video", "vsa/audio",
                    "fun_control/video", "fun_control/audio"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    return sp_ranks.write_setup(tmp_path_factory.mktemp("sp_setup"))


@pytest.fixture(scope="module")
def single(setup):
    """The scenarios in this process, with one compute thread like each rank."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return sp_ranks.run_scenarios(setup)
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module", params=[2, 4], ids=lambda n: f"{n}ranks")
def ranks(request, setup, tmp_path_factory):
    outputs, errors = sp_ranks.run_ranks(request.param, "scenarios", setup, tmp_path_factory.mktemp("sp_out"))
    assert not errors, errors
    assert sorted(outputs) == list(range(request.param))
    return outputs


def _assert_equal_within_bound(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.shape == want.shape, what
    assert torch.isfinite(got).all(), what
    scale = want.abs().max().item()
    assert scale > 0, f"{what}: the reference is all zeros, so the comparison would prove nothing"
    assert (got - want).abs().max().item() <= RELATIVE_BOUND * scale, what


@pytest.mark.parametrize("output", SCENARIO_OUTPUTS)
def test_every_rank_gives_the_single_process_output(ranks, single, output):
    for rank, outputs in ranks.items():
        _assert_equal_within_bound(outputs[output], single[output], f"rank {rank} of {len(ranks)}: {output}")


def test_the_scenarios_are_not_trivial(single):
    # Conditioning must change the result, or the comparisons above would not test that it reaches every rank.
    for name in ("fl2va", "ref2va", "masked", "lora", "vsa", "fun_control"):
        if single[f"{name}/video"].shape == single["t2va/video"].shape:
            assert not torch.equal(single[f"{name}/video"], single["t2va/video"]), name


def test_a_head_count_the_ranks_do_not_divide_is_refused(setup, tmp_path):
    outputs, errors = sp_ranks.run_ranks(4, "refused", setup, tmp_path)
    assert not errors, errors
    for rank in range(4):
        message = bytes(outputs[rank]["message"].tolist()).decode()
        assert "2 attention heads" in message and "4 ranks" in message and "1, 2" in message, message


@pytest.mark.parametrize("how", ["killed", "hung"])
def test_a_lost_rank_ends_the_job_with_an_error_within_the_timeout(setup, tmp_path, how):
    timeout_s = 8.0
    outputs, errors = sp_ranks.run_ranks(2, how, setup, tmp_path, timeout_s=timeout_s, wait_s=120.0)
    assert 0 in outputs, errors
    message = bytes(outputs[0]["message"].tolist()).decode()
    assert "rank 0 of 2" in message and "another rank of the group" in message, message
    # The surviving rank gives up within the collective timeout (plus the step it was in), not never.
    assert outputs[0]["seconds"].item() < timeout_s + 30.0
