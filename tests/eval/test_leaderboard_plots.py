"""The leaderboard's Pareto plots (predictor_training/eval/leaderboard_plots.py): point labels that stay inside the
plot and apart."""

from __future__ import annotations


def test_plot_labels_stay_inside_and_apart():
    """Labels of the right half point left (the plot's right edge cut them), two rows at one cost, close in PSNR,
    get labels one line apart, and a long label that would cover a higher row's point moves a line down."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from predictor_training.eval.leaderboard_plots import label_points

    fig, ax = plt.subplots()
    label_points(ax, [("3-step", 1.15, 56.0), ("1-step", 1.64, 30.6), ("cache", 1.641, 30.2), ("2-step", 1.35, 44.5)])
    placed = {text.get_text(): text for text in ax.texts}
    plt.close(fig)
    assert placed["3-step"].get_ha() == "left" and placed["1-step"].get_ha() == "right"
    assert placed["1-step"].xyann[1] - placed["cache"].xyann[1] == 8
    assert placed["2-step"].xyann == (3, 2)
    # a long label pointing left over a higher row's point at another cost moves down; a short one does not
    fig, ax = plt.subplots()
    label_points(ax, [("3-step", 1.15, 56.0), ("mixture", 1.50, 33.3), ("P a long Predictor label F-R-R-P", 1.58, 32.8),
                      ("P short", 1.30, 32.8)])
    placed = {text.get_text(): text for text in ax.texts}
    plt.close(fig)
    assert placed["P a long Predictor label F-R-R-P"].xyann == (-4, -6) and placed["P short"].xyann == (3, 2)
