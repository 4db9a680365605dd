"""The one robust fitter (lm.numbers.fit): exact non-negative least squares, one design or a batch, and the
Huber reweighting that keeps an outlier from bending a law."""

import numpy as np
import pytest

from lm.numbers.fit import huber_delta, huber_loss, huber_weights, nnls, robust_nnls


def random_problem(seed: int, p: int = 30, k: int = 3):
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(p, k))
    y = X @ rng.normal(size=k) + rng.normal(0.0, 0.1, p)
    return X, y, rng.uniform(0.2, 2.0, p)


def assert_kkt(X, y, w, coef, tol=1e-8):
    """The optimality conditions of NNLS: coef >= 0; the gradient of the weighted error is 0 on every positive
    coefficient and >= 0 on every zero one (moving it up would not help)."""
    grad = X.T @ (w * (X @ coef - y))
    scale = np.abs(X.T @ (w * y)).max()
    assert (coef >= 0).all()
    assert np.all(np.abs(grad[coef > 0]) <= tol * scale)
    assert np.all(grad[coef == 0] >= -tol * scale)


def test_a_feasible_problem_gets_the_ordinary_least_squares_solution():
    X = np.stack([np.ones(5), np.arange(5.0), np.arange(5.0) ** 2], axis=1)
    y = 1.0 + 2.0 * np.arange(5.0) + 0.5 * np.arange(5.0) ** 2
    coef, sse = nnls(X, y)
    assert coef == pytest.approx([1.0, 2.0, 0.5], abs=1e-12)
    assert sse == pytest.approx(0.0, abs=1e-20)


def test_a_negative_unconstrained_coefficient_is_held_at_zero():
    # y = 3 - x: the best non-negative fit by [1, x] is the constant at y's mean (the slope would be negative).
    x = np.arange(6.0)
    coef, sse = nnls(np.stack([np.ones(6), x], axis=1), 3.0 - x)
    assert coef == pytest.approx([float(np.mean(3.0 - x)), 0.0])
    assert sse == pytest.approx(float(np.sum((x - x.mean()) ** 2)))


@pytest.mark.parametrize("seed", range(40))
def test_random_problems_meet_the_optimality_conditions(seed):
    X, y, w = random_problem(seed)
    coef, sse = nnls(X, y, w)
    assert_kkt(X, y, w, coef)
    assert sse == pytest.approx(float(np.sum(w * (X @ coef - y) ** 2)), rel=1e-10)
    # No feasible point does better.
    rng = np.random.default_rng(seed + 1000)
    for _ in range(200):
        c = np.abs(coef + rng.normal(0.0, 0.3, coef.size))
        assert np.sum(w * (X @ c - y) ** 2) >= sse - 1e-12


def test_the_solution_agrees_with_scipy():
    optimize = pytest.importorskip("scipy.optimize")
    for seed in range(20):
        X, y, w = random_problem(seed, k=4)
        coef, _ = nnls(X, y, w)
        sw = np.sqrt(w)
        reference, _ = optimize.nnls(X * sw[:, None], y * sw)
        assert coef == pytest.approx(reference, abs=1e-9)


def test_weights_scale_the_rows():
    X, y, w = random_problem(3)
    coef, sse = nnls(X, y, w)
    sw = np.sqrt(w)
    same, same_sse = nnls(X * sw[:, None], y * sw)
    assert coef == pytest.approx(same, rel=1e-10) and sse == pytest.approx(same_sse, rel=1e-10)


def test_a_batch_solves_each_design_on_its_own():
    problems = [random_problem(seed) for seed in range(8)]
    X = np.stack([p[0] for p in problems])
    y, w = problems[0][1], problems[0][2]  # one y and w shared by the batch, as a law's grid has them
    coef, sse = nnls(X, y, w)
    for i, p in enumerate(problems):
        one, one_sse = nnls(p[0], y, w)
        assert coef[i] == pytest.approx(one, abs=1e-10) and sse[i] == pytest.approx(one_sse, rel=1e-10)


def test_columns_of_very_different_sizes_are_solved_exactly():
    # The Chinchilla law's columns: 1, N^-alpha (~1e-3) and D^-beta (~1e-3 to 1e-7).
    n = np.repeat([1e5, 3e5, 1e6, 3e6], 3)
    d = np.tile([1e6, 4e6, 1.6e7], 4)
    X = np.stack([np.ones(12), n**-0.42, d**-0.9], axis=1)
    coef, _ = nnls(X, X @ np.array([2.1, 60.0, 9e4]))
    assert coef == pytest.approx([2.1, 60.0, 9e4], rel=1e-8)


def test_a_zero_or_repeated_column_is_no_error():
    x = np.arange(1.0, 7.0)
    for X in (np.stack([np.ones(6), x, np.zeros(6)], axis=1), np.stack([np.ones(6), x, x], axis=1)):
        coef, sse = nnls(X, 1.0 + 2.0 * x)
        assert (coef >= 0).all() and np.isfinite(coef).all()
        assert X @ coef == pytest.approx(1.0 + 2.0 * x) and sse == pytest.approx(0.0, abs=1e-18)
        batch, _ = nnls(np.stack([X, X]), 1.0 + 2.0 * x)
        assert batch[0] @ X.T == pytest.approx(1.0 + 2.0 * x)


def test_huber_weights_and_loss():
    r = np.array([0.0, 0.005, -0.01, 0.02, -0.1])
    assert huber_weights(r, 0.01) == pytest.approx([1.0, 1.0, 1.0, 0.5, 0.1])
    assert huber_loss(r, 0.01) == pytest.approx(0.5 * 0.005**2 + 0.5 * 0.01**2 + 0.01 * 0.015 + 0.01 * 0.095)
    # The adaptive threshold: 1.5 x the median absolute residual (0.01 here), per design of a batch.
    assert huber_delta(r) == pytest.approx(0.015)
    assert huber_weights(r) == pytest.approx([1.0, 1.0, 1.0, 0.75, 0.15])
    assert huber_delta(np.stack([r, 2 * r])) == pytest.approx([0.015, 0.03])


def test_an_outlier_bends_a_plain_fit_but_not_the_robust_one():
    rng = np.random.default_rng(0)
    x = np.linspace(0.0, 1.0, 40)
    X = np.stack([np.ones(40), x], axis=1)
    y = 2.0 + 0.5 * x + rng.normal(0.0, 0.005, 40)
    y[-3] += 1.0  # one diverged run
    plain, _ = nnls(X, y)
    robust, loss = robust_nnls(X, y, delta=0.01)
    assert np.abs(robust - [2.0, 0.5]).max() < 0.01
    assert np.abs(plain - [2.0, 0.5]).max() > 5 * np.abs(robust - [2.0, 0.5]).max()
    assert loss == pytest.approx(huber_loss(X @ robust - y, 0.01))
    # A batch picks its best design by the Huber loss: the true column beats a wrong one.
    wrong = np.stack([np.ones(40), x**3], axis=1)
    _, losses = robust_nnls(np.stack([wrong, X]), y, delta=0.01)
    assert losses[1] < losses[0]
