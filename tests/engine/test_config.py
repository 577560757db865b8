"""The engine process reads the model config the client sent as plain fields
(colo.engine.reference.server.model_config), not as a rebuilt transformers.Qwen2Config:
it must see the same model either way, and a config missing a field is refused."""

import pytest

from colo.engine.reference.dims import Dims
from colo.engine.reference.server import CONFIG_FIELDS, model_config
from colo.trainers.models import DEMO_MODELS, demo_model_config


@pytest.mark.parametrize("name", sorted(DEMO_MODELS))
def test_the_engine_reads_the_same_dims_from_the_sent_dict_as_from_qwen2config(name):
    config = demo_model_config(name)
    assert Dims.from_config(model_config(config.to_dict())) == Dims.from_config(config)


@pytest.mark.parametrize("field", CONFIG_FIELDS)
def test_a_sent_config_missing_a_field_is_refused_naming_it(field):
    d = demo_model_config(sorted(DEMO_MODELS)[0]).to_dict()
    del d[field]
    with pytest.raises(ValueError, match=f"config lacks {field}"):
        model_config(d)


def test_a_sent_config_that_is_not_a_dict_is_refused():
    with pytest.raises(ValueError, match="config must be a dict"):
        model_config(["vocab_size", 10])
