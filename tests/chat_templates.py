"""Chat templates with tools, tool calls, tool results and a thinking switch, for the API tests.

Written for these tests in the two styles real templates use for a call's arguments: MAPPING
iterates them (`arguments|items`, as XML-style call formats do) and TEXT concatenates them as a JSON
string. Both render `tools` with `tojson`, answer tool results in a user-side block, and open a
think block in the prompt when `enable_thinking` is set (as templates that think by default do).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

MAPPING = (
    "{{ bos_token }}"
    "{%- if tools %}<|im_start|>system\n# Tools\n{%- for tool in tools %}\n{{ tool | tojson }}{%- endfor %}"
    "<|im_end|>\n{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' %}<|im_start|>assistant\n{{ message.content or '' }}"
    "{%- for call in message.tool_calls or [] %}<tool_call>\n<function={{ call.function.name }}>\n"
    "{%- for key, value in call.function.arguments|items %}<parameter={{ key }}>\n{{ value }}\n</parameter>\n"
    "{%- endfor %}</function>\n</tool_call>{%- endfor %}<|im_end|>\n"
    "{%- elif message.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ message.content }}\n</tool_response>"
    "<|im_end|>\n"
    "{%- else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- if enable_thinking %}<think>\n{%- endif %}{%- endif %}"
)

TEXT = (
    "{{ bos_token }}"
    "{%- if tools is not none %}## Tools\n{%- for tool in tools %}{{ tool.function | tojson }}\n{%- endfor %}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' and message.tool_calls %}<A>"
    "{%- for call in message.tool_calls %}<call>{{ call.function.name + '\n```json\n' + call.function.arguments"
    " + '\n```' }}</call>{%- endfor %}"
    "{%- elif message.role == 'tool' %}<result>{{ message.content }}</result>"
    "{%- elif message.role == 'assistant' %}<A>{{ message.content }}"
    "{%- else %}<{{ message.role }}>{{ message.content }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<A>{%- endif %}"
)


def with_template(model: Path, dst: Path, template: str, context: int | None = None) -> Path:
    """A copy of a checkpoint folder (weights linked) whose chat template is `template` (and whose
    context is `context` tokens: rendered tools are long in the tiny vocabulary)."""
    dst.mkdir(parents=True, exist_ok=True)
    for f in model.iterdir():
        target = dst / f.name
        if f.name == "tokenizer_config.json":
            config = json.loads(f.read_text())
            config["chat_template"] = template
            target.write_text(json.dumps(config, ensure_ascii=False))
        elif f.name == "config.json" and context is not None:
            config = json.loads(f.read_text())
            config["max_position_embeddings"] = context
            target.write_text(json.dumps(config))
        elif not target.exists():
            if f.suffix == ".safetensors":
                target.symlink_to(f)
            elif f.is_file():
                shutil.copy(f, target)
    return dst
