"""Chat `messages` rows through the sft stage's tokenization (issue 16, item 2).

transformers 5.x returns a BatchEncoding from `apply_chat_template(tokenize=True)`; `prompt +
response` then raised TypeError and every chat dataset failed before training started."""
import json

import pytest

from rlhf_core.data.tokenize import chat_ids, prompt_ids, response_ids

pytestmark = pytest.mark.unit

CHAT = [
    {"messages": [{"role": "user", "content": "Q: 12+30="}, {"role": "assistant", "content": " 42"}]},
    {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "Q: 1+2="},
                  {"role": "assistant", "content": " 3"}]},
]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    from rlhf_core.models.tiny import build_tokenizer

    out = tmp_path_factory.mktemp("chat_tok")
    build_tokenizer(["Q: 12+30= A: 42 user: assistant: system: be brief"] * 10, vocab_size=300).save_pretrained(out)
    return out


def test_chat_template_ids_are_a_plain_list(tokenizer_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    ids = chat_ids(tok, CHAT[0]["messages"][:1])
    assert isinstance(ids, list) and all(isinstance(t, int) for t in ids)
    text = tok.apply_chat_template(CHAT[0]["messages"][:1], add_generation_prompt=True, tokenize=False)
    assert ids == tok(text, add_special_tokens=False).input_ids  # the template's own text, nothing added
    assert prompt_ids(tok, CHAT[0]) == ids and prompt_ids(tok, {"prompt": "Q: 1+2="}) == tok("Q: 1+2=").input_ids


def test_sft_stage_tokenizes_a_chat_dataset(tokenizer_dir, tmp_path):
    """The sft stage's own data path (`stages.sft.build_spec`) on a `messages` file: the prompt is
    every turn but the last, through the chat template; the loss is on the assistant's reply + EOS."""
    from transformers import AutoTokenizer

    from stages.sft import Config, build_spec

    train, evals = tmp_path / "chat.jsonl", tmp_path / "eval.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for r in CHAT))
    evals.write_text(json.dumps({"prompt": "Q: 1+2=", "label": "3"}) + "\n")
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    for use_chat_template in (False, True):  # chat rows take the template either way
        cfg = Config(model_path=str(tokenizer_dir), train_data=str(train), eval_data=str(evals), output_dir=str(tmp_path / "out"),
                     use_chat_template=use_chat_template)
        spec, _ = build_spec(cfg, tmp_path / "out")
        assert len(spec.examples) == 2
        for ex, row in zip(spec.examples, CHAT):
            prompt = chat_ids(tok, row["messages"][:-1])
            reply = response_ids(tok, row["messages"][-1]["content"])
            assert ex["input_ids"] == prompt + reply and reply[-1] == tok.eos_token_id
            assert ex["loss_mask"] == [0] * len(prompt) + [1] * len(reply)
        batch = spec.collate(spec.examples)
        assert batch["input_ids"].shape[0] == 2
