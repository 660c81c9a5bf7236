"""`ctxcache worker` as a real process with a real sidecar, through the openai SDK."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from tests.utils import ServiceProcess
from tests.worker.conftest import Sidecar


@pytest.fixture
def worker(tiny_model: Path, sidecar: Sidecar, tmp_path: Path) -> Iterator[ServiceProcess]:
    proc = ServiceProcess(
        [
            "worker",
            "--model",
            str(tiny_model),
            "--sidecar",
            sidecar.lm_url,
            "--chunk-size",
            "32",
            "--threads",
            "1",
        ],
        log_path=tmp_path / "worker.log",
    )
    proc.command += ["--port", str(proc.port)]
    with proc:
        yield proc


def test_worker_process_through_the_openai_sdk(worker: ServiceProcess) -> None:
    with openai.OpenAI(base_url=f"{worker.url}/v1", api_key="unused") as client:
        _conversation(client)


def _conversation(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list()] == ["tiny"]
    session = {
        "kv_transfer_params": {"lmcache.tag.s": "cli"},
        "return_token_ids": True,
        "ignore_eos": True,
    }
    first = client.completions.create(
        model="tiny",
        prompt=" ".join(["token"] * 80),
        max_tokens=8,
        temperature=0,
        extra_body=session,
    )
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    ids = (
        first.choices[0].model_extra["prompt_token_ids"] + first.choices[0].model_extra["token_ids"]
    )
    second = client.completions.create(
        model="tiny", prompt=[*ids, 42], max_tokens=4, temperature=0, extra_body=session
    )
    assert second.usage.prompt_tokens == len(ids) + 1
    # the KV of the first turn (all but its last token) is hot in the worker's L1
    assert second.usage.prompt_tokens_details.cached_tokens == (len(ids) - 1) // 16 * 16

    chat = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hello"}], max_tokens=5, temperature=0
    )
    assert chat.choices[0].message.role == "assistant"
    stream = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "hello"}],
        max_tokens=5,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == chat.choices[0].message.content
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 5

    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(model="tiny", prompt=[5] * 5000, max_tokens=1)
    assert exc.value.code == "context_length_exceeded"
