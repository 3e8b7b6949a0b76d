"""bench/_results_page.py: a bench's `--write` replaces its own section of bench/RESULTS.md and nothing else."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("bench_results_page", ROOT / "bench" / "_results_page.py")
page_mod = sys.modules.setdefault("bench_results_page", importlib.util.module_from_spec(_spec))
_spec.loader.exec_module(page_mod)


def block(name: str, body: str) -> str:
    begin, end = page_mod.markers(name)
    return f"{begin}\n## {name}\n\n{body}\n{end}\n"


HEAD = "# Bench results\n\nHow this page works.\n\n"
PAGE = HEAD + block("cpu_moe", "| a | b |\n|---|---|\n| 1 | 2 |") + "\n" + block("e2e", "old e2e") + "\n" + \
    block("serving", "tail section, trailing text after it") + "\nclosing words\n"


def test_replace_keeps_every_other_byte():
    new = block("e2e", "new e2e\nwith two lines")
    out = page_mod.replace_section(PAGE, "e2e", new)
    old = block("e2e", "old e2e")
    start = PAGE.index(old)
    assert out == PAGE[:start] + new + PAGE[start + len(old):]
    assert out.count("<!-- bench:e2e begin -->") == 1 and "old e2e" not in out
    assert page_mod.replace_section(out, "e2e", old) == PAGE  # and back


def test_replace_first_and_last_sections():
    for name in ("cpu_moe", "serving"):
        out = page_mod.replace_section(PAGE, name, block(name, "x"))
        assert out.startswith(HEAD) and out.endswith("\nclosing words\n")
        assert block("e2e", "old e2e") in out and block(name, "x") in out


def test_missing_section_is_appended():
    new = block("triton_kernels", "| t |")
    out = page_mod.replace_section(PAGE, "triton_kernels", new)
    assert out == PAGE + "\n" + new
    assert page_mod.replace_section(HEAD + "\n\n\n", "gpu_smoke", new) == HEAD + new  # one blank line before it


def test_names_that_prefix_others_stay_apart():
    page = block("e2e", "a") + block("e2e_gpu", "b")
    assert page_mod.replace_section(page, "e2e", block("e2e", "c")) == block("e2e", "c") + block("e2e_gpu", "b")


def test_section_says_date_machine_and_command():
    text = page_mod.section("cpu_moe", "CPU experts", "\n| a |\n|---|\n\n", argv=[str(ROOT / "bench" / "cpu_moe.py"),
                            "--quick", "--engine-flags", '{"a": 1}'], machine_line="CPU X; GPU: none", date="2026-12-07")
    assert text == ("<!-- bench:cpu_moe begin -->\n## CPU experts\n\n- Date: 2026-12-07\n- Machine: CPU X; GPU: none\n"
                    "- Command: `python bench/cpu_moe.py --quick --engine-flags '{\"a\": 1}'`\n\n"
                    "| a |\n|---|\n<!-- bench:cpu_moe end -->\n")


def test_machine_line_reads_doctors_probes():
    from ktlite.machine import cpu_features, cpu_model

    line = page_mod.machine()
    assert cpu_model() in line and cpu_features() in line and "GPU: " in line


def test_write_section_creates_then_replaces(tmp_path):
    path = tmp_path / "RESULTS.md"
    page_mod.write_section("e2e", block("e2e", "one"), path)
    page_mod.write_section("serving", block("serving", "two"), path)
    page_mod.write_section("e2e", block("e2e", "three"), path)
    assert path.read_text() == "# Bench results\n\n" + block("e2e", "three") + "\n" + block("serving", "two")


def test_recorded_prints_and_keeps_a_copy(capsys):
    with page_mod.recorded() as copy:
        print("| row |", flush=True)
    assert copy.getvalue() == "| row |\n" and capsys.readouterr().out == "| row |\n"


def bench_scripts() -> list[Path]:
    return sorted(p for p in (ROOT / "bench").glob("*.py") if not p.name.startswith("_"))


def test_every_bench_writes_its_own_section():
    page = page_mod.PAGE.read_text()
    assert bench_scripts()
    for script in bench_scripts():
        name, source = script.stem, script.read_text()
        writes = f'publish("{name}"' in source or (f'write_section("{name}"' in source and f'section("{name}"' in source)
        assert '"--write"' in source and writes, name
        begin, end = page_mod.markers(name)
        assert page.count(begin) == 1 and page.count(end) == 1 and page.index(begin) < page.index(end), name


def test_page_sections_say_date_machine_and_command():
    page = page_mod.PAGE.read_text()
    assert "bench/history/" in page
    for script in bench_scripts():
        begin, end = page_mod.markers(script.stem)
        text = page[page.index(begin):page.index(end)]
        if "Not run yet" not in text:  # a bench never measured says so instead of inventing figures
            assert re.search(r"\n- Date: \d{4}-\d\d-\d\d\n- Machine: .+\n- Command: `python bench/"
                             + re.escape(script.name), text), script.stem


# a figure: numbers (ranges, "a / b" lists) followed by a unit, or a ratio such as 0.57-0.73x
FIGURE = re.compile(r"(\d+(?:\.\d+)?(?:\s*[-/]\s*\d+(?:\.\d+)?)*)(?:\s*(?:%|ms\b|us\b|tok/s|GB/s|req/s|bits/weight|of peak)|x\b)")


def missing_figures(text: str, page: str) -> list[str]:
    """The numbers of `text`'s figures that `page` does not show (as whole numbers: 2.3 is not in 12.34)."""
    numbers = (n for m in FIGURE.finditer(text) for n in re.findall(r"\d+(?:\.\d+)?", m.group(1)))
    return [n for n in numbers if not re.search(rf"(?<![\d.]){re.escape(n)}(?!\d|\.\d)", page)]


def test_readme_quotes_only_figures_on_the_page():
    readme, page = (ROOT / "README.md").read_text(), page_mod.PAGE.read_text()
    bench = readme.split("\n## Benchmarks\n", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in bench.splitlines() if line.startswith("| ") and not line.startswith("| what |")]
    cited = [p for p in readme.split("\n\n") if "bench/RESULTS.md" in p]  # prose that names the page as its source
    assert rows and cited
    for chunk in rows + cited:
        assert not missing_figures(chunk, page), (missing_figures(chunk, page), chunk[:200])
    assert missing_figures("INT4 0.57-0.73x, 12.345 ms", page) == ["12.345"]  # the check does catch a stray figure
