"""The documentation site builds strictly, its figures draw from the committed results, its examples run."""

from __future__ import annotations

import ast
import builtins
import html
import importlib.util
import json
import logging
import os
import re
import subprocess
import sys
import typing
from pathlib import Path
from typing import Any

import pytest
from pydantic import ByteSize, TypeAdapter
from pydantic_core import PydanticUndefined

import aiokvtier

ROOT = Path(__file__).resolve().parents[1]
ENV = {
    **os.environ,
    "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    "NO_MKDOCS_2_WARNING": "1",
    "MPLBACKEND": "Agg",
}
FIGURES = ["fill-vs-upfront", "probe-stalls", "copy-bandwidth", "server-latency"]


def _run(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=ENV, timeout=timeout, cwd=ROOT)


class Site:
    def __init__(self, root: Path, log: str) -> None:
        self.root, self.log = root, log

    def text(self, page: str) -> str:
        """A built page's text, its tags stripped and its entities decoded."""
        return html.unescape(re.sub(r"<[^>]+>", "", (self.root / page / "index.html").read_text()))


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Site:
    """The site, built once strictly for the tests that read it."""
    pytest.importorskip("mkdocs")
    pytest.importorskip("material")
    pytest.importorskip("mkdocstrings_handlers.python")
    out = tmp_path_factory.mktemp("site")
    done = _run("-m", "mkdocs", "build", "--strict", "--config-file", "mkdocs.yml", "--site-dir", str(out))
    assert done.returncode == 0, done.stderr[-4000:]
    return Site(out, done.stderr)


def test_mkdocs_build_strict(site: Site) -> None:
    assert (site.root / "index.html").exists()
    for page in ("guide", "design", "configuration", "operations", "api", "figures", "benchmarks", "changelog"):
        assert (site.root / page / "index.html").exists(), page
    api = (site.root / "api" / "index.html").read_text()
    assert "wait_resident" in api and "BlockStore" in api  # rendered from the docstrings
    for name in FIGURES:
        assert (site.root / "figures" / f"{name}.svg").exists()


def test_the_build_logs_nothing_about_the_pages(site: Site) -> None:
    """No warning, and no INFO line past mkdocs' own three (griffe's docstring notes were INFO before)."""
    own = ("Cleaning site directory", "Building documentation to directory", "Documentation built in")
    lines = [line for line in site.log.splitlines() if re.match(r"(INFO|WARNING|ERROR)\b", line)]
    assert lines, site.log[-2000:]  # the log was captured
    others = [line for line in lines if not (line.startswith("INFO") and any(o in line for o in own))]
    assert not others, others


SPHINX_ROLE = re.compile(r":(meth|class|func|attr|exc|data|mod|obj):")


def test_the_api_reference_renders_no_sphinx_roles(site: Site) -> None:
    api = site.text("api")
    assert not SPHINX_ROLE.findall(api), [api[m.start() - 60 : m.end() + 40] for m in SPHINX_ROLE.finditer(api)]
    for name in ("TierClosedError", "HostTier.statistics", "BlockStore"):  # the markdown that replaced them
        assert name in api
    # Field lists render as tables (a field not at the start of a line stays text), literal blocks as code.
    for leftover in re.finditer(r":(param|raises|ivar|returns|rtype)\b|::$", api, re.M):
        raise AssertionError(api[leftover.start() - 60 : leftover.end() + 40])


def test_the_package_docstrings_use_no_sphinx_roles() -> None:
    """Cross-references are markdown the API page renders (``x`` or [``x``][aiokvtier.X]), not Sphinx roles."""
    found = [
        f"{path.relative_to(ROOT)}:{n}"
        for path in sorted((ROOT / "aiokvtier").rglob("*.py"))
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if re.search(SPHINX_ROLE.pattern + "`", line)
    ]
    assert not found, found


def test_the_api_reference_shows_only_public_bases(site: Site) -> None:
    page = (site.root / "api" / "index.html").read_text()
    bases = [
        name.strip()
        for match in re.findall(r"Bases: (.*?)</p>", page, re.S)
        for name in html.unescape(re.sub(r"<[^>]+>", "", match)).split(",")
    ]
    assert "AiokvtierError" in bases and "ValueError" in bases  # the error hierarchy keeps its bases
    for name in bases:
        assert name in aiokvtier.__all__ or isinstance(getattr(builtins, name, None), type), name
    for private in ("Owner", "_Frozen", "_Collector"):
        assert private not in bases


def test_long_signatures_are_laid_out_one_parameter_a_line(site: Site) -> None:
    """The formatter the docs extra installs (Ruff) lays them out; without one they would be one long line."""
    api = site.text("api")
    assert re.search(r"CopyEngine\(\n    device: int \| None,\n    \*,\n    streams: int = 2,\n", api)


def test_the_docs_hooks_warn_when_no_formatter_can_lay_out_signatures(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    spec = importlib.util.spec_from_file_location("_aiokvtier_docs_hooks", ROOT / "docs" / "_hooks.py")
    assert spec is not None and spec.loader is not None
    hooks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hooks)
    with caplog.at_level(logging.WARNING, logger="mkdocs.hooks.aiokvtier"):
        hooks.on_startup(command="build", dirty=False)
        assert not caplog.records
        monkeypatch.setattr(hooks.importlib.util, "find_spec", lambda name: None)
        hooks.on_startup(command="build", dirty=False)
    assert [r.levelno for r in caplog.records] == [logging.WARNING] and "Ruff" in caplog.text


def test_readme_links_are_absolute_and_point_at_files_in_the_repository() -> None:
    """The README is the package index's long description, where a relative link has nowhere to go."""
    markdown_it = pytest.importorskip("markdown_it")
    rendered = markdown_it.MarkdownIt("commonmark").render((ROOT / "README.md").read_text())
    links = re.findall(r'href="([^"]*)"', rendered)
    assert len(links) >= 15  # the pages, the examples, the changelog and the licence
    repo = "https://github.com/aiokvtier/aiokvtier/"
    for link in links:
        assert link.startswith("https://"), link
        if link.startswith(repo):
            path = re.sub(r"^(blob|tree)/main/", "", link.removeprefix(repo))
            assert (ROOT / path).exists(), link


def test_plots_draw_every_figure_from_the_committed_results(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    done = _run("docs/plots.py", "--out", str(tmp_path), "--format", "png")
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout)
    assert list(summary) == FIGURES
    for name in FIGURES:
        image = tmp_path / f"{name}.png"
        assert summary[name] == str(image)
        assert image.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and image.stat().st_size > 10_000
        assert (ROOT / "docs" / "figures" / f"{name}.svg").exists()  # the pages show the committed SVGs


def _plots() -> Any:
    spec = importlib.util.spec_from_file_location("_aiokvtier_docs_plots", ROOT / "docs" / "plots.py")
    assert spec is not None and spec.loader is not None
    plots = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plots)
    return plots


@pytest.mark.parametrize("name", FIGURES)
def test_figures_read_at_the_width_the_site_shows_them(name: str) -> None:
    """Drawn for the text column: 1200 px as PNG, text of 10 pt or more, nothing cut off, legends beside
    the data rather than on it, bar labels inside their axes."""
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt
    from matplotlib.text import Text

    plots = _plots()
    with plt.rc_context(plots.STYLE):
        fig = plots.FIGURES[name](ROOT / "docs" / "results")
        try:
            fig.canvas.draw()
            renderer = fig.canvas.get_renderer()  # type: ignore[attr-defined]
            width, height = fig.get_size_inches()
            assert width * plots.DPI >= 1200 and width <= 8.5  # the column shows about 8 in at 1:1
            small = {
                t.get_text(): t.get_fontsize() for t in fig.findobj(Text) if t.get_text() and t.get_fontsize() < 10
            }
            assert not small, small
            drawn = fig.get_tightbbox(renderer)  # inches
            assert drawn.x0 >= -0.01 and drawn.y0 >= -0.01 and drawn.x1 <= width + 0.01 and drawn.y1 <= height + 0.01
            legends = [ax.get_legend() for ax in fig.axes if ax.get_legend()] + list(fig.legends)
            for legend in legends:
                box = legend.get_window_extent(renderer)
                assert not any(box.overlaps(ax.bbox) for ax in fig.axes), name
            for ax in fig.axes:
                for text in ax.texts:
                    box = text.get_window_extent(renderer)
                    assert ax.bbox.x0 - 1 <= box.x0 and box.x1 <= ax.bbox.x1 + 1, text.get_text()
        finally:
            plt.close(fig)


def test_fill_figure_draws_a_recorded_gpu_series_where_the_results_have_one(tmp_path: Path) -> None:
    # The GPU panel draws lines from rates until a `bench cuda` run records fill_progress; then the steps.
    pytest.importorskip("matplotlib")
    results = tmp_path / "results"
    results.mkdir()
    for name in ("cuda-h200.json", "fill-progress-devvm.json", "host-h200.json"):
        (results / name).write_text((ROOT / "docs" / "results" / name).read_text())
    cuda = json.loads((results / "cuda-h200.json").read_text())
    host = json.loads((results / "fill-progress-devvm.json").read_text())["fill_progress"]
    cuda["fill_progress"] = {
        "quota_gib": host["quota_gib"],
        "aiokvtier_vmm": host["aiokvtier_host"],
        "aiokvtier_register": host["aiokvtier_host"],
        "cuMemHostAlloc_s": host["upfront_resident_s"],
        "torch_pinned_empty_s": None,
    }
    (results / "cuda-h200.json").write_text(json.dumps(cuda))
    done = _run("docs/plots.py", "--results", str(results), "--out", str(tmp_path / "out"), "--format", "svg")
    assert done.returncode == 0, done.stderr
    svg = (tmp_path / "out" / "fill-vs-upfront.svg").read_text()
    assert "recorded: resident bytes sampled" in svg and "not a recorded time series" not in svg
    assert "torch pinned" not in svg and "2-vCPU VM" in svg


def test_plots_skip_what_the_results_lack(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    (tmp_path / "results").mkdir()
    done = _run("docs/plots.py", "--results", str(tmp_path / "results"), "--out", str(tmp_path / "out"))
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout)
    assert all(v.startswith("skipped: ") and "missing" in v for v in summary.values())
    assert not list((tmp_path / "out").iterdir())


@pytest.mark.parametrize("page", ["index.md", "configuration.md"])
def test_python_examples_in_the_docs_run(page: str, tmp_path: Path) -> None:
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "docs" / page).read_text(), re.S)
    assert blocks
    for i, block in enumerate(blocks):
        script = tmp_path / f"block{i}.py"
        script.write_text(block)
        done = _run(str(script), timeout=120)
        assert done.returncode == 0, done.stderr


PROGRAM_PAGES = ["disk.md", "store.md"]
"""Pages, besides those above, with a whole program (one that calls ``asyncio.run``) among their excerpts."""


def _whole_programs(page: Path) -> list[str]:
    return [block for block in re.findall(r"```python\n(.*?)```", page.read_text(), re.S) if "asyncio.run(" in block]


def test_every_page_with_a_whole_program_runs_it() -> None:
    """A page's excerpts stand for code around them; a whole program on a page is run by the test below."""
    pages = sorted(p.relative_to(ROOT / "docs").as_posix() for p in (ROOT / "docs").rglob("*.md") if _whole_programs(p))
    assert pages == sorted(["index.md", "configuration.md", *PROGRAM_PAGES])


@pytest.mark.parametrize("page", PROGRAM_PAGES)
def test_whole_programs_in_the_docs_run(page: str, tmp_path: Path) -> None:
    blocks = _whole_programs(ROOT / "docs" / page)
    assert blocks
    for i, block in enumerate(blocks):
        script = tmp_path / f"block{i}.py"
        script.write_text(block)
        done = _run(str(script), timeout=120)
        assert done.returncode == 0, done.stderr


def test_index_example_is_about_twenty_lines() -> None:
    block = re.findall(r"```python\n(.*?)```", (ROOT / "docs" / "index.md").read_text(), re.S)[0]
    assert 15 <= len(block.strip().splitlines()) <= 22


def test_configuration_page_names_every_field() -> None:
    from aiokvtier import CacheConfig, DiskTierConfig, GpuTierConfig, HostTierConfig

    text = (ROOT / "docs" / "configuration.md").read_text()
    for model in (HostTierConfig, GpuTierConfig, DiskTierConfig, CacheConfig):
        section = text.split(f"## `{model.__name__}`", 1)[1].split("\n## ", 1)[0]
        for field in model.model_fields:
            assert f"| `{field}` |" in section, f"{model.__name__}.{field} is not documented"


def test_every_page_is_in_the_nav() -> None:
    nav = (ROOT / "mkdocs.yml").read_text()
    for page in (ROOT / "docs").glob("*.md"):
        assert f" {page.name}" in nav, f"{page.name} is not in mkdocs.yml's nav"


def test_ci_runs_every_check_the_readme_names() -> None:
    readme = (ROOT / "README.md").read_text()
    block = readme.split("Run the checks", 1)[1].split("\n\n", 2)[1]
    ci = (ROOT / ".ci" / "run").read_text()
    assert "python3 -m venv" in ci and "pip install -e '.[test]'" in ci  # from the package index, fresh
    for line in block.splitlines():
        for command in line.strip().split(" && "):
            assert command.split(" --site-dir")[0] in ci, command
    assert "mkdocs build --strict" in ci and "python -m pytest -q" in ci


def _documented_default(cell: str) -> object:
    """The value a configuration table's default cell names: ``required``, ``None: ...``, or a literal."""
    if cell == "required":
        return PydanticUndefined
    if cell.startswith("None"):
        return None
    literal = re.fullmatch(r"`([^`]+)`", cell)
    assert literal, f"a default cell that names no value: {cell!r}"
    text = literal.group(1)
    if text in ("True", "False") or (text[0] in "\"'0123456789" and not text[-1].isalpha()):
        return ast.literal_eval(text)
    return int(TypeAdapter(ByteSize).validate_python(text))  # a size such as 2MiB


def test_configuration_page_gives_each_fields_default() -> None:
    """The defaults the page states are the models' (``fill_threads`` was documented as 1, not per CPU)."""
    from aiokvtier import CacheConfig, DiskTierConfig, GpuTierConfig, HostTierConfig

    text = (ROOT / "docs" / "configuration.md").read_text()
    for model in (HostTierConfig, GpuTierConfig, DiskTierConfig, CacheConfig):
        section = text.split(f"## `{model.__name__}`", 1)[1].split("\n## ", 1)[0]
        for name, field in model.model_fields.items():
            row = next(line for line in section.splitlines() if line.startswith(f"| `{name}` |"))
            cells = [cell.strip() for cell in row.strip("|").split(" | ")]
            default = field.default
            if isinstance(default, ByteSize):
                default = int(default)
            assert _documented_default(cells[2]) == default, f"{model.__name__}.{name}: {row}"
            strings = [
                arg for t in typing.get_args(field.annotation) for arg in typing.get_args(t) if isinstance(arg, str)
            ]
            for value in strings:  # each literal value the field takes is named in its type
                assert f'"{value}"' in cells[1], f"{model.__name__}.{name} takes {value!r}: {row}"


def test_the_store_page_names_every_statistics_field() -> None:
    """docs/store.md's table left out the tiers below' figures and ``subscribers``."""
    import dataclasses

    from aiokvtier import StoreStatistics

    text = (ROOT / "docs" / "store.md").read_text()
    section = text.split("\n## Statistics\n", 1)[1].split("\n## ", 1)[0]
    named = {
        name
        for row in section.splitlines()
        if row.startswith("| `")
        for name in re.findall(r"`(\w+)`", row.split(" | ")[0])
    }
    assert named == {f.name for f in dataclasses.fields(StoreStatistics)}
