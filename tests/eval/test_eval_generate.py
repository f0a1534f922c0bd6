"""Greedy decoding of the workbench's model (`WorkbenchLM`): a batch of prompts of different
lengths, decoded together right-padded, gives each prompt the tokens that decoding it alone,
one full forward per token (the plain loop, written here as the oracle), gives; a row that
meets its stop sequence stops while the others go on; the model's `logits_at_B` is its full
logits at those positions."""

from __future__ import annotations

import pytest
import torch

from workbench.arch import preset
from workbench.model import MoEForCausalLM

CHARS = ["<pad>", "<eos>", *"abcdefghijklmnopqrstuvwxyz .,\n"]


@pytest.fixture(scope="module")
def lm():
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    from workbench.eval.lm import WorkbenchLM

    # one token per character (BPE without merges), decoded by concatenation
    tk = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(CHARS)}, merges=[]))
    tk.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", eos_token="<eos>")
    model = MoEForCausalLM(preset("tiny", vocab_size=len(CHARS)), seed=5).eval()
    return WorkbenchLM(model, tok, name="tiny", batch_size=4)


def oracle(model, prompt: torch.Tensor, n: int) -> list[int]:
    seq, out = prompt[None], []
    with torch.no_grad():
        for _ in range(n):
            nxt = int(model(seq).logits[0, -1].argmax())
            out.append(nxt)
            seq = torch.cat([seq, seq.new_tensor([[nxt]])], dim=1)
    return out


def _prompts(lm) -> list[torch.Tensor]:
    texts = ["the cat", "a", "quantization aware training, in short", "moe."]
    return [torch.tensor(lm.tokenizer(t, add_special_tokens=False)["input_ids"]) for t in texts]


def test_logits_at_positions_are_the_full_logits_there(lm):
    model = lm.model.module
    ids = torch.randint(2, len(CHARS), (3, 11), generator=torch.Generator().manual_seed(0))
    at = torch.tensor([10, 0, 4])
    with torch.no_grad():
        full = model(ids).logits
        picked = model(ids, logits_at_B=at).logits
    assert picked.shape == (3, 1, len(CHARS))
    torch.testing.assert_close(picked[:, 0], full[torch.arange(3), at], rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="no labels"):
        model(ids, ids, logits_at_B=at)


def test_batched_greedy_equals_each_prompt_decoded_alone(lm):
    prompts = _prompts(lm)
    made = lm._greedy(prompts, 9, stop=["<never>"])
    want = [oracle(lm.model.module, p, 9) for p in prompts]
    assert [m.tolist() for m in made] == want
    assert len({tuple(w) for w in want}) > 1  # the prompts lead to different answers


def test_a_row_that_meets_its_stop_stops_and_the_others_go_on(lm):
    prompts = _prompts(lm)
    want = [oracle(lm.model.module, p, 9) for p in prompts]
    # a stop string row 2 generates as its 3rd token (and whose text no other row makes first)
    stop = lm.tokenizer.decode(want[2][:3])
    made = [m.tolist() for m in lm._greedy(prompts, 9, stop=[stop])]
    for w, m in zip(want, made):
        for i in range(len(w)):  # the oracle's own stopping point for this row
            if stop in lm.tokenizer.decode(w[:i + 1]):
                assert m == w[:i + 1]
                break
        else:
            assert m == w
    assert len(made[2]) <= 3 and any(len(m) == 9 for m in made)


def test_model_generate_unpacks_the_left_padded_batch(lm):
    prompts = _prompts(lm)
    width = max(len(p) for p in prompts)
    context = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(context)
    for b, p in enumerate(prompts):  # left padding, as HFLM builds a generation batch
        context[b, width - len(p):] = p
        mask[b, width - len(p):] = 1
    out = lm._model_generate(context, width + 6, stop=["<never>"], attention_mask=mask,
                             do_sample=False)
    for b, p in enumerate(prompts):
        assert out[b, :width].tolist() == context[b].tolist()
        assert out[b, width:].tolist() == oracle(lm.model.module, p, 6)
