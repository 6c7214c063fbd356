"""An OpenAI app pointed at a vlmq fleet: chat completions that wait, structured outputs parsed
into a pydantic model, a stream, the fleet's models, and the timeout path.

    vlmq serve &                      # the API (and at least one `vlmq worker`)
    python examples/openai_chat.py [IMAGE]

Needs only the ``openai`` package. ``VLMQ_OPENAI_BASE_URL`` (default
``http://127.0.0.1:8000/v1``) and ``VLMQ_OPENAI_API_KEY`` (a key of ``VLMQ_API__API_KEYS``;
any text for a keyless loopback server) say where. With an IMAGE file it is sent as a data
URI (the API stages it in the results store; the workers read it from there).
"""

from __future__ import annotations

import base64
import mimetypes
import os
import sys
from typing import Any, Literal

import openai
from pydantic import BaseModel


class Verdict(BaseModel):
    answer: Literal["yes", "no"]
    confident: bool


def data_uri(path: str) -> str:
    kind = mimetypes.guess_type(path)[0] or "image/png"
    with open(path, "rb") as f:
        return f"data:{kind};base64,{base64.b64encode(f.read()).decode()}"


def question(text: str, image: str | None) -> list[Any]:
    if image is None:
        return [{"role": "user", "content": text}]
    parts = [{"type": "image_url", "image_url": {"url": data_uri(image)}}]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]


def main() -> None:
    image = sys.argv[1] if len(sys.argv) > 1 else None
    client = openai.OpenAI(
        base_url=os.environ.get("VLMQ_OPENAI_BASE_URL", "http://127.0.0.1:8000/v1"),
        api_key=os.environ.get("VLMQ_OPENAI_API_KEY", "none"),
        # A call waits for its task (up to VLMQ_API__SYNC_TIMEOUT_S on the server): give the
        # client longer. Retries would enqueue the task again: only where nothing ran.
        timeout=float(os.environ.get("VLMQ_OPENAI_TIMEOUT_S", "600")),
        max_retries=0,
    )
    print("models:", [m.id for m in client.models.list().data])

    # 1. A chat completion, answered when the fleet has run it.
    completion = client.chat.completions.create(
        model="vlmq",  # recorded; the fleet's workers decide the model
        messages=question("Describe this in one sentence.", image),
        max_tokens=32,
    )
    print("create:", completion.choices[0].message.content, completion.usage)

    # 2. Structured outputs: the JSON schema of a pydantic model constrains the decoding.
    parsed = client.chat.completions.parse(
        model="vlmq",
        messages=question("Is there a cat? Answer in JSON.", image),
        response_format=Verdict,
        max_tokens=64,
    )
    print("parse:", parsed.choices[0].message.parsed)

    # 3. A stream: the whole text arrives in one chunk when the task ends (no token
    # streaming), then the finish reason, the usage, and [DONE].
    stream = client.chat.completions.create(
        model="vlmq",
        messages=question("Say hello.", None),
        max_tokens=16,
        stream=True,
        stream_options={"include_usage": True},
    )
    for chunk in stream:
        for choice in chunk.choices:
            if choice.delta.content:
                print("stream:", choice.delta.content)
            if choice.finish_reason:
                print("stream finished:", choice.finish_reason)
        if chunk.usage:
            print("stream usage:", chunk.usage)

    # 4. A call the fleet did not finish in time: 504, and the task keeps running. Its status
    # (and then its result, GET {status_url}/result?format=openai) stay readable.
    try:
        client.chat.completions.create(model="vlmq", messages=question("Hi.", None))
    except openai.InternalServerError as error:
        body: Any = error.body
        if error.status_code != 504 or not isinstance(body, dict):
            raise
        print("timed out; the task is at", body["status_url"])


if __name__ == "__main__":
    main()
