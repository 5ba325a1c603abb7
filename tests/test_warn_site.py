"""mixprec's warnings name the user's line on every path that raises them (mixprec/warn_site.py)."""

from __future__ import annotations

import warnings

import torch
from torch import nn

import mixprec
from mixprec.warn_site import user_stacklevel


def _stuck_warnings(caught: list[warnings.WarningMessage]) -> list[warnings.WarningMessage]:
    return [w for w in caught if "were all skipped" in str(w.message)]


def test_the_stuck_warning_names_the_users_with_line_through_scale_loss() -> None:
    """apex's interface runs the scaler's update in scale_loss's exit, through contextlib: a fixed stacklevel
    named mixprec/amp.py there (a user trial)."""
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = mixprec.initialize(model, opt, opt_level="O1", loss_scale=1.0, verbosity=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(6):
            loss = model(torch.randn(3, 4)).sum() * float("inf")  # every step skipped at a static scale
            with mixprec.scale_loss(loss, opt) as scaled:
                scaled.backward()
            opt.step()
            opt.zero_grad()
    assert [w.filename for w in _stuck_warnings(caught)] == [__file__]


def test_the_stuck_warning_names_the_users_update_line() -> None:
    w = nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([w], lr=0.1)
    scaler = mixprec.GradScaler("cpu", init_scale=1.0)  # at the floor: nothing left to back off
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(6):
            scaler.scale((w * float("nan")).sum()).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
    assert [w.filename for w in _stuck_warnings(caught)] == [__file__]


def test_user_stacklevel_counts_from_the_warning_function() -> None:
    def warn() -> None:
        warnings.warn("here", UserWarning, stacklevel=user_stacklevel())

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warn()  # this file is outside mixprec and torch: the function's own line, level 1
    assert caught[0].filename == __file__ and caught[0].lineno == warn.__code__.co_firstlineno + 1
