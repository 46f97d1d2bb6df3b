"""What a torch.optim user counts on besides the update: step(closure), any list of parameters
(empty ones included), and state made of ordinary tensors."""
import pytest
import torch

from distro_opt import DeMo, DisTrOAdamW

from _models import OPTIMIZERS, batch, make_model


@pytest.mark.parametrize("cls", OPTIMIZERS)
def test_closure_is_called_with_grad_enabled_and_its_loss_returned(cls):
    model = make_model()
    opt = cls(model.parameters())
    x, y = batch(0)

    def closure():
        assert torch.is_grad_enabled()
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        return loss

    assert isinstance(opt.step(closure), torch.Tensor)


@pytest.mark.parametrize("cls", OPTIMIZERS)
def test_a_parameter_with_no_elements_is_accepted_and_left_alone(cls):
    empty, w = torch.nn.Parameter(torch.zeros(0, 8)), torch.nn.Parameter(torch.ones(8, 8))
    opt = cls([empty, w], lr=0.1)
    assert opt.payload_nbytes == cls([w], lr=0.1).payload_nbytes
    empty.grad, w.grad = torch.zeros(0, 8), torch.ones(8, 8)
    opt.step()
    assert empty.shape == (0, 8) and (w != 1).all()


def _state_tensors(opt):
    """Every tensor of the optimizer's state, the local-step mode's inner optimizer's included."""
    states = list(opt.state.values())
    if getattr(opt, "inner_optimizer", None) is not None:
        states += list(opt.inner_optimizer.state.values())
    return [t for st in states if isinstance(st, dict) for t in st.values() if torch.is_tensor(t)]


@pytest.mark.parametrize("make", [
    lambda ps: DisTrOAdamW(ps, lr=0.01),
    lambda ps: DisTrOAdamW(ps, lr=0.01, update="adam"),
    lambda ps: DisTrOAdamW(ps, lr=0.01, update="rms"),
    lambda ps: DisTrOAdamW(ps, lr=0.01, sync_every=2, outer_momentum=0.5),
    lambda ps: DisTrOAdamW(ps, lr=0.01, overlap=True),
    lambda ps: DeMo(ps, lr=0.01),
], ids=["sign", "adam", "rms", "local-steps", "overlap", "demo"])
@pytest.mark.parametrize("mixed", [False, True], ids=["float32", "float32+float64"])
def test_state_is_ordinary_tensors_that_users_can_update_in_place(make, mixed):
    """The step runs under inference mode; what it keeps must not be inference tensors, which
    torch refuses to update in place outside it."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 4))
    if mixed:
        model[1].double()
    opt = make(model.parameters())
    for _ in range(4):
        for p in model.parameters():
            p.grad = torch.randn_like(p)
        opt.step()
    tensors = _state_tensors(opt)
    assert tensors and not [t.shape for t in tensors if t.is_inference()]
    for t in tensors:
        t.mul_(1.0)  # raises for an inference tensor
    fresh = make(model.parameters())
    fresh.load_state_dict(opt.state_dict())
    for o in (opt, fresh):
        o.step()
        assert not [t.shape for t in _state_tensors(o) if t.is_inference()]
    assert all(torch.isfinite(p).all() for p in model.parameters())
