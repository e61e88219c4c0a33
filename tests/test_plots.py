"""Plots are valid PNG files that matplotlib reads back."""

import io

import matplotlib.image as mpimg
import pytest

from clgrpo.reports import plots


def assert_png(data: bytes) -> None:
    assert data[:8] == plots.PNG_SIGNATURE
    image = mpimg.imread(io.BytesIO(data), format="png")
    assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100


@pytest.mark.parametrize("empty", [False, True])
def test_run_plots_are_png(empty, tmp_path):
    steps = [] if empty else [0, 1, 2, 3]
    series = [
        plots.Series(
            "train",
            steps[1:],
            [0.2, 0.5, 0.7][: len(steps[1:])],
            [0.1, 0.4, 0.6][: len(steps[1:])],
            [0.3, 0.6, 0.8][: len(steps[1:])],
        ),
        plots.Series("held-out", steps, [0.2, 0.3, 0.6, 0.8][: len(steps)]),
    ]
    images = [
        plots.accuracy_plot(series),
        plots.library_size_plot(steps, [0, 2, 3, 3][: len(steps)]),
        plots.cost_plot(
            steps,
            [100, 900, 800, 700][: len(steps)],
            [50, 300, 250, 200][: len(steps)],
            [0.0, 0.01, 0.02, 0.015][: len(steps)],
        ),
    ]
    for data in images:
        assert_png(data)
    path = plots.write_png(images[0], tmp_path / "sub" / "accuracy.png")
    assert_png(path.read_bytes())
    assert plots.data_uri(images[0]).startswith("data:image/png;base64,iVBORw0KGgo")


def test_conditions_plot_is_png():
    points = [plots.ConditionPoint("none", 0.2, 0.15, 0.26), plots.ConditionPoint("run:3", 0.85, 0.8, 0.9)]
    assert_png(plots.conditions_plot("Mean@8", points))
