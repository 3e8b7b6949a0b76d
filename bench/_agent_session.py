"""The coding-agent session bench/agents.py replays: instructions, a dozen JSON-schema tools, and the turns.

Written for this bench (no agent's text is copied): a coding agent's operating instructions, twelve tools
with the kind of descriptions and schemas coding agents send, and a repository's documentation as project
context, sized to a target token count. Each later turn appends what an agent appends: the assistant's
reply with a tool call, the tool's result (read from this repository's own files, so it is real text of
a realistic size) and a short user message. Not a benchmark itself (the leading underscore keeps it out
of `ktlite bench`).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent

INSTRUCTIONS = """\
You are a coding agent working inside a user's software repository. You read code, run commands and edit \
files through the tools below, and you answer in the terminal the user is watching.

# How to work
- Understand before you change. Read the files involved, search for every caller of a function before you \
change its signature, and run the relevant tests before and after an edit.
- Make the smallest change that solves the problem the user described. Do not reformat code you did not \
otherwise touch, do not rename things for taste, and do not add dependencies without asking.
- Follow the conventions already in the repository: its naming, its test layout, its error handling, its \
comment style. When the repository has a contributor guide (AGENTS.md, CONTRIBUTING.md, a README section), \
follow it; it overrides these instructions where they disagree.
- Keep the user informed with short progress notes: what you found, what you are about to do. No long \
preambles, no restating the question.
- When a command fails, read its output, form a hypothesis, and test it. Do not retry the same command \
unchanged. After two failed attempts at the same approach, step back and say what you have learned.
- Never commit, push, or rewrite git history unless the user asks. Never delete files you did not create \
unless the user asks. Never run commands that need network access unless the user asks.
- Secrets: never print, log or commit credentials, tokens or private keys, even if you find them in files.

# Editing
- Use edit_file for changes to existing files: give enough of the old text to match exactly one place. \
Use write_file only for new files or complete rewrites the user asked for.
- After editing, re-read the changed region when the edit was non-trivial, and run the narrowest test that \
covers it. Report what you ran and what it printed.
- Preserve the file's existing indentation, line endings and encoding.

# Running commands
- Prefer the repository's own entry points (make targets, scripts in tools/ or bin/, the test runner it \
configures) over ad-hoc commands.
- Long-running commands (servers, watchers) must not block the session: run them with a timeout or in the \
background, and stop what you started when you are done.
- Quote paths that contain spaces. Use absolute paths in commands when the working directory is unclear.

# Answers
- Answer in plain prose with short code blocks where code helps. Name files as path:line so the user can \
click through. Say plainly what you did not verify.
- When the user asks a question rather than for a change, answer it; do not start editing.
"""


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict[str, Any]  # JSON schema of the arguments

    def openai(self) -> dict[str, Any]:
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": self.parameters}}

    def anthropic(self) -> dict[str, Any]:
        return {"name": self.name, "description": self.description, "input_schema": self.parameters}


def _schema(properties: dict[str, Any], required: list[str]) -> dict[str, Any]:
    return {"type": "object", "properties": properties, "required": required, "additionalProperties": False}


_PATH = {"type": "string", "description": "Path relative to the workspace root, or absolute."}

TOOLS = [
    Tool("read_file", "Read a text file. Returns the requested lines prefixed with their line numbers "
         "(`   12\\tcode`). Read large files in windows with offset and limit rather than whole; binary files "
         "are refused. Prefer this tool over `cat` in bash.",
         _schema({"path": _PATH, "offset": {"type": "integer", "minimum": 1, "description": "First line (1-based)."},
                  "limit": {"type": "integer", "minimum": 1, "maximum": 2000, "description": "Lines to return."}},
                 ["path"])),
    Tool("write_file", "Create a file or overwrite one completely. Only for new files or rewrites the user asked "
         "for; use edit_file to change part of an existing file. Parent folders are created.",
         _schema({"path": _PATH, "content": {"type": "string", "description": "The whole new content."}},
                 ["path", "content"])),
    Tool("edit_file", "Replace text in a file. old_text must match exactly one place in the file (including "
         "indentation) unless replace_all is true; include surrounding lines to make it unique. Fails without "
         "changing the file when there is no match or more than one.",
         _schema({"path": _PATH, "old_text": {"type": "string"}, "new_text": {"type": "string"},
                  "replace_all": {"type": "boolean", "default": False}}, ["path", "old_text", "new_text"])),
    Tool("bash", "Run a shell command in the workspace and return its exit code, stdout and stderr (each cut to "
         "30000 characters). The working directory persists between calls; environment changes do not. Give a "
         "timeout for anything that may run long; background long-lived processes and stop them afterwards.",
         _schema({"command": {"type": "string"},
                  "timeout_s": {"type": "integer", "minimum": 1, "maximum": 600, "default": 120},
                  "description": {"type": "string", "description": "Five to ten words on what the command does."}},
                 ["command"])),
    Tool("grep", "Search file contents with a regular expression (ripgrep syntax) under a folder, honouring "
         ".gitignore. Returns matching lines as path:line:text, or only file names, or counts.",
         _schema({"pattern": {"type": "string"}, "path": _PATH,
                  "glob": {"type": "string", "description": "Only files matching this glob, e.g. `*.py`."},
                  "case_insensitive": {"type": "boolean", "default": False},
                  "context_lines": {"type": "integer", "minimum": 0, "maximum": 20, "default": 0},
                  "output_mode": {"enum": ["content", "files_with_matches", "count"], "default": "content"}},
                 ["pattern"])),
    Tool("glob", "List files whose paths match a glob pattern (`**/*.py`, `src/**/test_*.ts`), newest first, at "
         "most 500.", _schema({"pattern": {"type": "string"}, "path": _PATH}, ["pattern"])),
    Tool("list_directory", "List a folder's entries with their kinds and sizes, folders first.",
         _schema({"path": _PATH, "include_hidden": {"type": "boolean", "default": False}}, ["path"])),
    Tool("run_tests", "Run the repository's test runner on a selection and return a summary of failures with "
         "their tracebacks. Prefer narrow selections (a file, a test id, a keyword).",
         _schema({"selection": {"type": "string", "description": "A path, a test id or a -k expression."},
                  "fail_fast": {"type": "boolean", "default": True},
                  "verbose": {"type": "boolean", "default": False}}, ["selection"])),
    Tool("git_status", "Show the working tree's status: branch, staged, unstaged and untracked files.",
         _schema({}, [])),
    Tool("git_diff", "Show changes: unstaged by default, staged with staged=true, or against a revision.",
         _schema({"staged": {"type": "boolean", "default": False},
                  "revision": {"type": "string", "description": "Compare the working tree with this revision."},
                  "paths": {"type": "array", "items": {"type": "string"}}}, [])),
    Tool("todo_write", "Replace the session's task list. Use it for work with three or more steps: keep exactly "
         "one item in_progress, mark items completed as soon as they are done, and add items you discover.",
         _schema({"todos": {"type": "array", "items": _schema(
             {"content": {"type": "string"}, "status": {"enum": ["pending", "in_progress", "completed"]},
              "priority": {"enum": ["high", "medium", "low"]}}, ["content", "status"])}}, ["todos"])),
    Tool("ask_user", "Ask the user a question and wait for the answer. Only when the task cannot go on without a "
         "decision only they can make; offer the options you see.",
         _schema({"question": {"type": "string"},
                  "options": {"type": "array", "items": {"type": "string"}, "maxItems": 4}}, ["question"])),
]


@dataclass(frozen=True)
class Step:
    """One later turn: the tool the assistant called after its reply, and the user's next message."""

    tool: str
    arguments: dict[str, Any]
    user: str


FIRST_MESSAGE = ("tests/test_prefix_cache.py started failing after my change to the radix cache's eviction. "
                 "Find out why and fix it; keep the change small.")
STEPS = [
    Step("read_file", {"path": "ktlite/runtime/radix_cache.py", "offset": 1, "limit": 12}, "Go on."),
    Step("grep", {"pattern": "def (evict|match|insert)", "path": "ktlite/runtime", "glob": "*.py"},
         "Where is eviction ordered?"),
    Step("read_file", {"path": "ktlite/runtime/radix_cache.py", "offset": 200, "limit": 12}, "Continue."),
    Step("read_file", {"path": "tests/test_prefix_cache.py", "offset": 1, "limit": 12}, "What does the test expect?"),
    Step("git_diff", {"paths": ["ktlite/runtime/radix_cache.py"]}, "Fix it and run the test."),
    Step("read_file", {"path": "ktlite/runtime/scheduler.py", "offset": 320, "limit": 12}, "Anything else?"),
]


def tool_result(step: Step) -> str:
    """The tool's output for a step, from this repository's files (numbered lines, grep hits, a diff)."""
    args = step.arguments
    if step.tool == "read_file":
        lines = (ROOT / args["path"]).read_text().splitlines()
        start = args["offset"]
        return "\n".join(f"{n:6d}\t{line}" for n, line in enumerate(lines[start - 1:start - 1 + args["limit"]], start))
    if step.tool == "grep":
        pattern, hits = re.compile(args["pattern"]), []
        for path in sorted((ROOT / args["path"]).rglob(args["glob"])):
            for n, line in enumerate(path.read_text().splitlines(), 1):
                if pattern.search(line):
                    hits.append(f"{path.relative_to(ROOT)}:{n}:{line.strip()}")
        return "\n".join(hits[:12])
    if step.tool == "git_diff":
        path = args["paths"][0]
        lines = (ROOT / path).read_text().splitlines()[60:72]
        body = "\n".join(f" {line}" for line in lines)
        return (f"diff --git a/{path} b/{path}\nindex 3f1c2ab..9d04e1f 100644\n--- a/{path}\n+++ b/{path}\n"
                f"@@ -61,12 +61,12 @@\n{body}")
    raise ValueError(f"no result for tool {step.tool!r}")


def project_context(chars: int) -> str:
    """`chars` characters of project documentation, as agents include a repository's guide."""
    doc = (ROOT / "README.md").read_text()
    text = doc
    while len(text) < chars:
        text += "\n\n" + doc
    return "# Project documentation (README.md)\n\n" + text[:chars]


class Session:
    """One agent session's conversation, rendered for the Anthropic or the OpenAI chat API.

    `session_id` opens the system prompt and the first tool's description (agents put the working folder
    there), so two sessions share no cached prefix; everything else is the same for every session."""

    def __init__(self, api: str, session_id: str, context_chars: int, max_tokens: int):
        self.api, self.max_tokens = api, max_tokens
        self.system = (f"Workspace: /home/dev/work/{session_id}\n\n{INSTRUCTIONS}\n{project_context(context_chars)}"
                       if context_chars else f"Workspace: /home/dev/work/{session_id}\n\n{INSTRUCTIONS}")
        first = TOOLS[0]
        self.tools = [Tool(first.name, f"{first.description} Workspace root: /home/dev/work/{session_id}.",
                           first.parameters), *TOOLS[1:]]
        self.messages: list[dict[str, Any]] = [{"role": "user", "content": FIRST_MESSAGE}]

    def body(self, model: str | None) -> dict[str, Any]:
        """The next request: the whole conversation so far, streamed, greedy."""
        body: dict[str, Any] = {"max_tokens": self.max_tokens, "temperature": 0.0, "stream": True,
                                "messages": self.messages}
        if model:
            body["model"] = model
        if self.api == "anthropic":
            body["system"] = [{"type": "text", "text": self.system, "cache_control": {"type": "ephemeral"}}]
            body["tools"] = [t.anthropic() for t in self.tools]
        else:
            body["messages"] = [{"role": "system", "content": self.system}, *self.messages]
            body["tools"] = [t.openai() for t in self.tools]
            body["stream_options"] = {"include_usage": True}
        return body

    def advance(self, reply: str, turn: int, step: Step) -> None:
        """Append the assistant's reply with the step's tool call, the tool's result and the user's message."""
        call_id = f"call_{turn:03d}"
        result = tool_result(step)
        if self.api == "anthropic":
            content: list[dict[str, Any]] = [{"type": "text", "text": reply}] if reply else []
            content.append({"type": "tool_use", "id": call_id, "name": step.tool, "input": step.arguments})
            self.messages += [{"role": "assistant", "content": content},
                              {"role": "user", "content": [
                                  {"type": "tool_result", "tool_use_id": call_id, "content": result},
                                  {"type": "text", "text": step.user}]}]
        else:
            call = {"id": call_id, "type": "function",
                    "function": {"name": step.tool, "arguments": json.dumps(step.arguments)}}
            self.messages += [{"role": "assistant", "content": reply or None, "tool_calls": [call]},
                              {"role": "tool", "tool_call_id": call_id, "content": result},
                              {"role": "user", "content": step.user}]
