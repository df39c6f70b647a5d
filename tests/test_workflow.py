"""The workflow definition: [[workflow.nodes]] in TOML, the built-in graph, checks that name the node, the
execution order."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

from titanrl.config import ConfigError, JobConfig, config_to_toml, load_config
from titanrl.config.loader import config_from_dict
from titanrl.workflow.graph import resolve

ROOT = Path(__file__).resolve().parents[1]


def with_nodes(tmp_path: Path, text: str, *overrides: str) -> JobConfig:
    path = tmp_path / "w.toml"
    path.write_text(text)
    return load_config(path, list(overrides))


def test_default_workflow_is_todays_step_in_order():
    wf = resolve(JobConfig())
    assert [n.id for n in wf.nodes] == ["data", "rollout", "reward", "advantage", "old_logprob", "ref_logprob",
                                         "update", "weight_sync"]
    assert wf.node("update").inputs == ("old_logprob", "ref_logprob")
    cfg = JobConfig()
    cfg.rl.kl_coef = 0.0  # no reference model: no reference node
    assert "ref_logprob" not in [n.id for n in resolve(cfg).nodes]


def test_an_added_node_rewires_the_graph_and_round_trips(tmp_path):
    cfg = with_nodes(tmp_path, '''
[[workflow.nodes]]
id = "drop_uniform"
function = "examples/dapo_filter.py:drop_uniform_groups"
inputs = ["reward"]

[[workflow.nodes]]
id = "advantage"
inputs = ["drop_uniform"]
''')
    wf = resolve(cfg)
    ids = [n.id for n in wf.nodes]
    assert ids.index("reward") < ids.index("drop_uniform") < ids.index("advantage")
    # placed where its input runs (the rollout group: colocated every rank)
    assert wf.node("drop_uniform").type == "compute" and wf.node("drop_uniform").placement == "rollout"
    assert wf.node("advantage").function == "group_advantages"  # unchanged fields kept
    reloaded = config_from_dict(tomllib.loads(config_to_toml(cfg)))
    assert reloaded == cfg


@pytest.mark.parametrize("text, message", [
    ('[[workflow.nodes]]\nid = "a"\nfunction = "m:f"\ninputs = ["nope"]\n',
     "workflow node 'a' reads 'nope', which is no node"),
    ('[[workflow.nodes]]\nid = "a"\nfunction = "m:f"\ninputs = ["b"]\n'
     '[[workflow.nodes]]\nid = "b"\nfunction = "m:f"\ninputs = ["a"]\n', "is on a cycle: a -> b -> a"),
    ('[[workflow.nodes]]\nid = "a"\nfunction = "softmax"\ninputs = ["reward"]\n',
     "workflow node 'a': unknown function 'softmax'"),
    ('[[workflow.nodes]]\nid = "a"\nfunction = "m:f"\ninputs = ["reward"]\nplacement = "gpus"\n',
     "workflow node 'a' is placed on 'gpus', which names no ranks"),
    ('[[workflow.nodes]]\nid = "a"\nfunction = "m:f"\ninputs = ["reward"]\nbogus = 1\n',
     "unknown key 'workflow.nodes[0].bogus'"),
])
def test_bad_workflows_are_config_errors_naming_the_node(tmp_path, text, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        with_nodes(tmp_path, text)


def test_nodes_are_set_in_toml_not_on_the_command_line():
    with pytest.raises(ConfigError, match="array of tables: set it in the TOML file"):
        load_config(None, ["--workflow.nodes=[]"])


def test_help_lists_the_nodes_of_a_config(tmp_path, capsys):
    from titanrl.config.loader import parse_args

    path = tmp_path / "w.toml"
    path.write_text('[[workflow.nodes]]\nid = "a"\nfunction = "m:f"\ninputs = ["reward"]\n')
    with pytest.raises(SystemExit):
        parse_args(["--config", str(path), "--help"])
    out = capsys.readouterr().out
    assert "workflow.nodes: array of tables (TOML file only) = 1 table(s)" in out
    assert '[[workflow.nodes]] #0: id="a", function="m:f", inputs=["reward"]' in out
