"""The calculator agent as an external program (`task.agent_command`, issue 31): the
standard library alone, speaking OpenAI's chat-completions API over HTTP, so that it runs
with nothing but the interpreter the sandbox has.

streamrl runs it once per episode in a sandbox whose network reaches only the endpoint:
OPENAI_BASE_URL and OPENAI_API_KEY name the endpoint and the episode's key, stdin holds
`{"prompt": ..., "data": ...}`, and what it prints is the episode's answer. Any program
that reads the two variables (the `openai` package does by itself) is run the same way.

    [task]
    agent_command = ["python3", "program.py"]
    agent_dir = "examples/openai_agent"
"""

from __future__ import annotations

import json
import os
import re
import sys
import urllib.request
from typing import Any

from calculator import CALCULATOR, calculate  # type: ignore[import-not-found]


def chat(messages: list[dict[str, Any]]) -> dict[str, Any]:
    """One chat-completions call: the reply message and its finish reason."""
    request = urllib.request.Request(
        os.environ["OPENAI_BASE_URL"].rstrip("/") + "/chat/completions",
        data=json.dumps({"model": "policy", "messages": messages, "tools": [CALCULATOR]}).encode(),
        headers={
            "Authorization": f"Bearer {os.environ['OPENAI_API_KEY']}",
            "Content-Type": "application/json",
        },
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        choice: dict[str, Any] = json.load(response)["choices"][0]
    return choice


def main() -> int:
    task = json.load(sys.stdin)
    messages: list[dict[str, Any]] = [{"role": "user", "content": task["prompt"]}]
    while True:
        reply = chat(messages)["message"]
        messages.append({k: v for k, v in reply.items() if v is not None})
        if not reply.get("tool_calls"):
            text = reply.get("content") or ""
            found = re.search(r"<answer>(.*?)</answer>", text, re.DOTALL)
            print(found.group(1).strip() if found else text.strip())
            return 0
        for call in reply["tool_calls"]:
            try:
                args = json.loads(call["function"]["arguments"])
                result = calculate(str(args.get("expression", "")))
            except (ValueError, AttributeError) as err:
                result = f"error: {err}"
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": result})


if __name__ == "__main__":
    sys.exit(main())
