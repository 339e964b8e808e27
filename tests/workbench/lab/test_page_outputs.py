"""What a cell's outputs become on a page (`moe_lab.workbench.lab.page_outputs`): an exercise
the reference answered says so, a progress bar is one line in one block, a long output is
folded. Each test renders a small synthetic executed notebook, built here, with the site's
own `render_page`, and reads the HTML it produces."""

from __future__ import annotations

import re
from html.parser import HTMLParser

import nbformat
import pytest

from moe_lab.workbench.lab import page_outputs, site

STUB = ("from moe_lab.workbench.exercises.nb01_naive_moe import check_tokens_per_expert\n\n\n"
        "def tokens_per_expert(expert_ids, n_experts):\n    # your answer here\n"
        "    return not_done()\n\n"
        "tokens_per_expert = check_tokens_per_expert(tokens_per_expert, solutions=SOLUTIONS)")
SOLVED = STUB.replace("return not_done()", "return expert_ids.flatten().bincount(minlength=n_experts)")
PASSED = "✓ tokens_per_expert is correct\n"


def _code(source: str, *outputs, tags: list[str] | None = None, count: int = 1):
    cell = nbformat.v4.new_code_cell(source, execution_count=count)
    cell.outputs = list(outputs)
    if tags:
        cell.metadata["tags"] = tags
    return cell


def _stdout(text: str):
    return nbformat.v4.new_output("stream", name="stdout", text=text)


def _notebook(*cells, solutions: bool | None = True):
    """A notebook as papermill leaves it: the parameters cell says ``SOLUTIONS = False``,
    the injected cell after it says what the run used (none when ``solutions`` is None)."""
    head = [nbformat.v4.new_markdown_cell("# 99 A page\n\nWhat it teaches."),
            _code("PROFILE = \"smoke\"\nSOLUTIONS = False", tags=["parameters"])]
    if solutions is not None:
        head.append(_code(f'# Parameters\nPROFILE = "smoke"\nSOLUTIONS = {solutions}\n',
                          tags=["injected-parameters"]))
    nb = nbformat.v4.new_notebook(cells=[*head, *cells])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    return nb


def _tqdm_fragments(total: int = 60) -> list:
    """A text tqdm bar as nbclient saves it from a headless run: one stream output per
    redraw, each starting with a carriage return, the last ending the line."""
    fragments = [_stdout(f"\rtrain tiny: {100 * n // total:3d}%|{'#' * (n * 10 // total):<10}| "
                         f"{n}/{total} [00:0{n % 10}<00:00, 40.0it/s]") for n in range(0, total + 1, 5)]
    fragments.append(_stdout("\n"))
    return fragments


class _Blocks(HTMLParser):
    """The text of each output block of a page (``jp-OutputArea-output``), and whether it
    sits inside a ``<details>``."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks: list[dict] = []
        self._stack: list[tuple[str, bool]] = []  # (tag, opens an output block)
        self._details = 0

    def handle_starttag(self, tag, attrs):
        classes = (dict(attrs).get("class") or "").split()
        opens = tag == "div" and "jp-OutputArea-output" in classes
        if tag == "details":
            self._details += 1
        if opens:
            self.blocks.append({"text": "", "folded": self._details > 0, "html": []})
        if tag not in ("br", "img", "meta", "link", "input", "hr"):
            self._stack.append((tag, opens))

    def handle_endtag(self, tag):
        if tag == "details":
            self._details -= 1
        while self._stack:
            open_tag, _ = self._stack.pop()
            if open_tag == tag:
                break

    def handle_data(self, data):
        if any(opens for _, opens in self._stack):
            block = self.blocks[-1]
            block["text"] += data
            if self._details > 0:
                block["folded"] = True


def blocks(page: str) -> list[dict]:
    parser = _Blocks()
    parser.feed(page)
    return parser.blocks


def unfolded_text_lines(page: str) -> list[int]:
    """Line counts of the text of a page's output blocks that are not inside ``<details>``."""
    # Text inside <details> is folded; drop it before counting.
    unfolded = re.sub(r"<details\b.*?</details>", "", page, flags=re.S)
    return [len(b["text"].strip("\n").split("\n")) for b in blocks(unfolded) if b["text"].strip()]


# ------------------------------------------------------------------------------ exercises


def test_a_stub_answered_by_the_reference_says_not_done_never_a_tick():
    page = site.render_page(_notebook(_code(STUB, _stdout(PASSED), tags=["exercise"])))
    assert "✓" not in page
    assert "not done — the reference ran in its place" in page
    assert "tokens_per_expert: not done" in page


def test_a_written_answer_under_solutions_true_says_it_was_not_checked():
    page = site.render_page(_notebook(_code(SOLVED, _stdout(PASSED), tags=["exercise"])))
    assert "✓" not in page
    assert "not checked — the reference ran in place of the answer above" in page


def test_a_written_answer_checked_in_learner_mode_keeps_its_tick():
    page = site.render_page(_notebook(_code(SOLVED, _stdout(PASSED), tags=["exercise"]),
                                      solutions=False))
    assert "✓ tokens_per_expert is correct" in page


@pytest.mark.parametrize("solutions", [True, False, None])
def test_a_stub_never_shows_a_tick_whatever_the_mode(solutions):
    triton_stub = ("@triton.jit\ndef row_softmax_kernel(x_ptr):\n"
                   '    tl.static_assert(False, "exercise not solved yet")\n\n'
                   "row_softmax_kernel = check_row_softmax(row_softmax_kernel, solutions=SOLUTIONS)")
    nb = _notebook(_code(triton_stub, _stdout("✓ row_softmax_kernel matches torch.softmax\n"),
                         tags=["exercise"]), solutions=solutions)
    page = site.render_page(nb)
    assert "✓" not in page and "row_softmax_kernel: not done" in page


def test_the_learners_not_done_report_is_left_as_it_is():
    report = ("◻ exercise 'tokens_per_expert' is not done yet. To do: write it.\n"
              "  Meanwhile the cells below use the reference solution.\n")
    page = site.render_page(_notebook(_code(STUB, _stdout(report), tags=["exercise"]),
                                      solutions=False))
    assert "is not done yet" in page and "not done — the reference" not in page


def test_a_tick_outside_an_exercise_is_kept():
    page = site.render_page(_notebook(_code("print('✓ shapes agree')", _stdout("✓ shapes agree\n"))))
    assert "✓ shapes agree" in page


def test_run_solutions_reads_the_injected_value_first():
    assert page_outputs.run_solutions(_notebook(solutions=True)) is True
    assert page_outputs.run_solutions(_notebook(solutions=False)) is False
    assert page_outputs.run_solutions(_notebook(solutions=None)) is False  # the parameters cell
    assert page_outputs.run_solutions(nbformat.v4.new_notebook()) is None


# ------------------------------------------------------------------------------ progress bars


def test_a_progress_bar_is_one_block_showing_its_final_line():
    nb = _notebook(_code("train(cfg)", _stdout("profile smoke\n"), *_tqdm_fragments(),
                         _stdout("final loss 3.1\n")))
    page = site.render_page(nb)
    bars = [b for b in blocks(page) if "it/s" in b["text"]]
    assert len(bars) == 1, [b["text"] for b in bars]
    lines = bars[0]["text"].strip("\n").split("\n")
    assert lines == ["profile smoke", lines[1], "final loss 3.1"], lines
    assert "60/60" in lines[1] and "100%" in lines[1]
    assert page.count("train tiny:") == 1


def test_final_states_keeps_the_last_redraw_of_each_line():
    assert page_outputs.final_states("a 0%\ra 50%\ra 100%\nnext\r\n") == "a 100%\nnext\n"
    assert page_outputs.final_states("abc\x08\x08d\n") == "ad\n"


def test_streams_of_different_names_or_split_by_a_figure_are_not_merged():
    figure = nbformat.v4.new_output("display_data", data={"text/plain": "<Figure>"})
    nb = _notebook(_code("x", _stdout("one\n"), figure, _stdout("two\n"),
                         nbformat.v4.new_output("stream", name="stderr", text="moe_lab: note\n")))
    prepared = site.prepare_for_site(nb)
    assert [o.get("text", o.get("data")) for o in prepared.cells[-1].outputs] == [
        "one\n", {"text/plain": "<Figure>"}, "two\n", "moe_lab: note\n"]


# ------------------------------------------------------------------------------ long outputs


def test_an_output_longer_than_a_screen_is_folded_and_a_short_one_is_not():
    listing = "".join(f"row {i:3d} | {'x' * 20}\n" for i in range(137))
    nb = _notebook(_code("print(table)", _stdout(listing)),
                   _code("print(short)", _stdout("".join(f"line {i}\n" for i in range(60)))))
    page = site.render_page(nb)
    assert max(unfolded_text_lines(page)) <= page_outputs.FOLD_LINES
    assert page.count("<details") == 1
    assert "137 lines of output" in page and "row 136" in page  # folded, not lost
    assert "line 59" in page and re.search(r"<pre>\s*line 0", page)  # 60 lines stay open


def test_long_plain_and_markdown_results_are_folded_too():
    plain = nbformat.v4.new_output("execute_result", execution_count=1,
                                   data={"text/plain": "\n".join(map(str, range(80)))})
    table = "| a | b |\n|---|---|\n" + "".join(f"| {i} | {i * i} |\n" for i in range(90))
    markdown = nbformat.v4.new_output("display_data", data={"text/markdown": table,
                                                            "text/plain": "<IPython.Markdown>"})
    page = site.render_page(_notebook(_code("value", plain), _code("show(table)", markdown)))
    assert page.count("<details") == 2
    assert max(unfolded_text_lines(page), default=0) <= page_outputs.FOLD_LINES
    assert "<td>89</td>" in page  # the Markdown table is rendered inside its fold


def test_the_checks_here_fail_on_a_page_left_as_executed():
    """The helpers above see the faults on a page exported without `page_outputs`."""
    from nbconvert import HTMLExporter

    listing = "".join(f"row {i}\n" for i in range(100))
    nb = _notebook(_code(STUB, _stdout(PASSED), tags=["exercise"]),
                   _code("train(cfg)", *_tqdm_fragments()), _code("print(t)", _stdout(listing)))
    raw, _ = HTMLExporter(template_name="lab").from_notebook_node(nb)
    assert "✓" in raw
    assert len([b for b in blocks(raw) if "it/s" in b["text"]]) > 1
    assert max(unfolded_text_lines(raw)) > page_outputs.FOLD_LINES


def test_a_pipe_escaped_in_a_table_cell_is_a_pipe_on_the_page_code_included():
    page = page_outputs.markdown_to_html("| p | layout |\n|---|---|\n| 4 | `Et*16\\|t*16` a\\|b |\n\n"
                                         "`x\\|y` outside a table\n")
    cells = re.findall(r"<td>(.*?)</td>", page)
    assert cells == ["4", "<code>Et*16|t*16</code> a|b"], page
    assert "<code>x\\|y</code>" in page  # outside a table, code is left as written
