"""The chunked cross-entropy (``training.loss_chunk_tokens``, ``ray_titan.trainer.chunked_loss``)
against the plain loss (``cross_entropy_loss``): values and gradients (hidden states, head weight)
in fp32 and bf16, with ignored labels and the loss masks' scale; the whole model (untied and tied
heads) with document masks; and the loss's peak of live bytes, which the chunks must lower."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ray_titan.data.loader import IGNORE_INDEX
from ray_titan.models.registry import build_model
from ray_titan.trainer.build import _loss, cross_entropy_loss
from ray_titan.trainer.chunked_loss import ChunkedCrossEntropy


def _inputs(dtype: torch.dtype, batch=2, seq=37, dim=16, vocab=97):
    g = torch.Generator().manual_seed(0)
    head = nn.Linear(dim, vocab, bias=False).to(dtype)
    with torch.no_grad():
        head.weight.copy_(torch.randn(vocab, dim, generator=g) * 0.3)
    hidden = torch.randn(batch, seq, dim, generator=g).to(dtype)
    labels = torch.randint(0, vocab, (batch, seq), generator=g)
    labels[0, :5] = IGNORE_INDEX  # a masked prompt
    labels[1, -3:] = IGNORE_INDEX
    return head, hidden, labels


def _value_and_grads(loss_of, head, hidden, labels, scale):
    h = hidden.clone().requires_grad_(True)
    head.weight.grad = None
    loss = loss_of(h, labels, scale)
    loss.backward()
    return loss.detach(), h.grad, head.weight.grad.clone()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scale", [None, 0.37])
@pytest.mark.parametrize("chunk", [8, 37, 1000])  # uneven chunks, one row's length, all in one
def test_values_and_gradients_equal_the_plain_loss(dtype, scale, chunk):
    head, hidden, labels = _inputs(dtype)
    plain = _value_and_grads(lambda h, y, s: cross_entropy_loss(head(h), y, s), head, hidden, labels, scale)
    chunked = _value_and_grads(ChunkedCrossEntropy(head, chunk), head, hidden, labels, scale)
    assert chunked[0].dtype == torch.float32
    for got, want in zip(chunked, plain):
        if dtype == torch.float32:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        else:  # bf16: the head weight's gradient is summed over the chunks in bf16 (a rounding each)
            assert got.dtype == want.dtype
            assert (got.float() - want.float()).norm() <= 1e-2 * want.float().norm()


def test_no_gradient_mode_gives_the_same_value():
    head, hidden, labels = _inputs(torch.float32)
    with torch.no_grad():
        got = ChunkedCrossEntropy(head, 10)(hidden, labels, 1.0)
        want = cross_entropy_loss(head(hidden), labels, 1.0)
    torch.testing.assert_close(got, want)


def test_chunk_must_be_positive():
    with pytest.raises(ValueError, match="chunk = 0"):
        ChunkedCrossEntropy(nn.Identity(), 0)


@pytest.mark.parametrize("name", ["llama", "qwen3"])  # untied head; tied to the embedding
def test_whole_model_with_document_masks_equals_the_plain_loss(name):
    from ray_titan.config import load_config, merge_overrides
    from tests.conftest import REPO

    over = [f"--model.name={name}", "--model.flavor=debug"]
    cfg = load_config(REPO / "configs" / "debug_llama.toml", merge_overrides(over, ["--training.loss_chunk_tokens=24"]))
    torch.manual_seed(0)
    model = build_model(cfg.model.name, cfg.model.flavor, vocab_size=61, max_seq_len=64)
    model.init_weights(3)
    assert model.tied == (name == "qwen3")
    x = torch.randint(0, 61, (2, 40))
    y = torch.randint(0, 61, (2, 40))
    y[:, :4] = IGNORE_INDEX
    positions = torch.cat([torch.arange(15), torch.arange(25)]).repeat(2, 1)  # two documents per row

    def grads(loss_fn):
        model.zero_grad(set_to_none=True)
        loss = loss_fn(model(x, positions=positions), y, 0.5)
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    plain = grads(cross_entropy_loss)
    loss_fn = _loss(cfg, {0: model}, 0)
    assert isinstance(loss_fn, ChunkedCrossEntropy) and model.hidden_out
    assert model(x).shape == (2, 40, model.args.dim)  # the last stage now gives hidden states
    chunked = grads(loss_fn)
    torch.testing.assert_close(chunked[0], plain[0])
    assert chunked[1].keys() == plain[1].keys()
    for n in plain[1]:
        torch.testing.assert_close(chunked[1][n], plain[1][n], rtol=1e-5, atol=1e-6, msg=n)


def _peak_bytes(fn) -> int:
    """The most CPU bytes allocated at once while ``fn`` runs, above what was allocated before
    it: the largest ``total_allocated`` of the profiler's allocation events (torch's CPU
    allocator's running total), less the total before the first of them."""
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events, todo = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while todo:
        e = todo.pop()
        todo.extend(e.children)
        if e.tag == _EventType.Allocation:
            events.append(e)
    events.sort(key=lambda e: e.start_time_ns)
    before = events[0].extra_fields.total_allocated - events[0].extra_fields.alloc_size
    return max(e.extra_fields.total_allocated for e in events) - before


def test_chunks_lower_the_peak_of_the_loss():
    """Forward and backward of the loss over 2048 tokens of a 4096-token vocabulary: the plain
    loss holds the logits (fp32 32 MiB apiece) and their gradients; in chunks of 256 tokens an
    eighth of that. Fails if the chunks stop bounding what is live."""
    head = nn.Linear(64, 4096, bias=False)
    hidden = torch.randn(2, 1024, 64, requires_grad=True)
    labels = torch.randint(0, 4096, (2, 1024))

    def run(loss_fn):
        return lambda: loss_fn(hidden, labels, None).backward()

    plain = _peak_bytes(run(lambda h, y, s: cross_entropy_loss(head(h), y, s)))
    chunked = _peak_bytes(run(ChunkedCrossEntropy(head, 256)))
    logits = 2048 * 4096 * 4
    print(f"loss peak: plain {plain / 2**20:.1f} MiB, chunks of 256 {chunked / 2**20:.1f} MiB")
    assert plain >= 2 * logits
    assert chunked < plain / 4


def test_memory_plan_follows_the_setting_on_the_8b_row():
    """Issue 41's row (Llama 3.1 8B, FSDP 8, 2 × 8192 tokens, vocabulary 128256, bf16, selective
    op AC): the plain loss's transient is its fp32 gradients over the vocabulary (15.7 GiB);
    in chunks of 2048 tokens the loss's own backward holds at least 4× less, and the rank's
    transient at its peak falls 3.2× (to a block's backward), and the activations
    lose the log-softmax the plain loss keeps (4 bytes × tokens × vocabulary)."""
    from ray_titan.config import load_config
    from ray_titan.preflight.memory_plan import memory_plan
    from ray_titan.preflight.plan_activations import _loss_backward
    from ray_titan.preflight.plan_job import _job
    from tests.conftest import REPO

    def config(chunk):
        return load_config(REPO / "configs" / "debug_llama.toml", [
            "--model.name=llama", "--model.flavor=3.1-8B", "--parallelism.pp=1", "--parallelism.dp_shard=8",
            "--parallelism.microbatches=1", "--training.seq_len=8192", "--training.global_batch_size=16",
            "--activation_checkpoint.mode=selective", "--activation_checkpoint.selective_option=op",
            "--training.mixed_precision=bf16", f"--training.loss_chunk_tokens={chunk}"])

    def rank0(chunk):
        return memory_plan(config(chunk), device="cuda", levers=False, vocab_size=128256).ranks[0]

    plain, chunked = rank0(0), rank0(2048)
    # The loss's own backward (bytes per token above what is kept): at least 4× less in chunks.
    loss_plain, loss_chunked = (_loss_backward(_job(config(c), "cuda", 1.0, 128256)) for c in (0, 2048))
    assert loss_plain / loss_chunked >= 4.0
    tokens_x_vocab = 2 * 8192 * 128256
    assert plain.transient == pytest.approx(2 * 4 * tokens_x_vocab, rel=1e-3)
    print(f"8B row transient: plain {plain.transient / 2**30:.2f} GiB, chunked {chunked.transient / 2**30:.2f} GiB")
    # 3.2×: chunked, the peak moment is no longer the loss's backward but a block's (the plan holds
    # 0.1 GiB of its unsharded gradients then), whose transient (4.9 GiB) the loss does not change;
    # the loss's own moment is lower still. It read 4.0× until 2026-11-28, when the plan stopped
    # counting AC's kept block inputs in fp32 and two blocks' gathered parameters at the loss's
    # backward (both measured on the simulated GPU), which had kept the loss's moment the peak.
    assert plain.transient / chunked.transient >= 3.2
    assert chunked.peak_grads > 0 and plain.peak_grads == 0  # a block's backward / the loss's
    assert plain.activations - chunked.activations >= 4 * tokens_x_vocab
