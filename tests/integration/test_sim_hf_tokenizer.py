"""A local Hugging Face tokenizer directory (built here with `tokenizers`, no hub) drives the pods."""

from __future__ import annotations

import json
from pathlib import Path

import aiohttp

from picker_sim import Fleet, FleetConfig

TEMPLATE = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }} {% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}"


def _build_tokenizer(directory: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["[UNK]", "[", "]", "user", "assistant", "system", "hello", "world", "be", "brief", "."]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "unk_token": "[UNK]",
                "chat_template": TEMPLATE,
            }
        )
    )


async def test_hf_tokenizer_and_its_chat_template(tmp_path: Path) -> None:
    _build_tokenizer(tmp_path)
    fleet = Fleet(FleetConfig(pods=1, profile="tiny", time_scale=20, tokenizer=str(tmp_path)))
    await fleet.start()
    try:
        url = fleet.pods[0].url
        async with aiohttp.ClientSession() as http:
            async with http.post(url + "/tokenize", json={"prompt": "hello world zebra"}) as resp:
                tok = await resp.json()
            assert tok["tokens"] == [6, 7, 0] and tok["token_strs"] == ["hello", "world", "[UNK]"]
            messages = [{"role": "system", "content": "be brief ."}, {"role": "user", "content": "hello"}]
            async with http.post(url + "/tokenize", json={"messages": messages}) as resp:
                chat = await resp.json()
            # "[system] be brief . [user] hello [assistant]" through the template, word by word
            assert chat["tokens"] == [1, 5, 2, 8, 9, 10, 1, 3, 2, 6, 1, 4, 2]
            async with http.post(url + "/v1/chat/completions", json={"messages": messages, "max_tokens": 2}) as resp:
                assert (await resp.json())["usage"]["prompt_tokens"] == 13
    finally:
        await fleet.stop()
