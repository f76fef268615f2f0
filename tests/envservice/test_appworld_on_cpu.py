"""AppWorld without its data: the id is registered and listed, and /create fails with an `env_error` that names
the data path and the commands to run (or, with data but no package, how to install it)."""

from __future__ import annotations

import sys

from envservice import registry
from envservice.envs import appworld_env
from envservice.envs.appworld_env import DATASET_SIZES, AppWorldEnv


def _create(client, task_id=0, split="train"):
    return client.post("/create", json={"env_id": "appworld", "task_id": task_id, "split": split, "seed": 0})


def test_registered_and_listed_without_data(make_client) -> None:
    assert "appworld" in registry.registered_ids()
    client = make_client(env_ids=["appworld", "search"])
    listed = {spec["id"]: spec for spec in client.get("/envs").json()["envs"]}
    assert listed["appworld"]["tasks"] == DATASET_SIZES


def test_missing_data_is_an_env_error_naming_path_and_commands(make_client, monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("APPWORLD_ROOT", str(tmp_path))
    response = _create(make_client(env_ids=["appworld"]))
    assert response.status_code == 500
    body = response.json()
    assert body["code"] == "env_error"
    assert body["message"].startswith(f"AppWorld data not found at {tmp_path / 'data'}; run "
                                      "`appworld install && appworld download data`")


def test_data_without_package_says_how_to_install(make_client, monkeypatch, tmp_path) -> None:
    (tmp_path / "data" / "tasks").mkdir(parents=True)
    monkeypatch.setenv("APPWORLD_ROOT", str(tmp_path))
    monkeypatch.setitem(sys.modules, "appworld", None)  # importing it fails, as in this venv
    response = _create(make_client(env_ids=["appworld"]))
    assert response.status_code == 500 and response.json()["code"] == "env_error"
    assert "AppWorld is not installed" in response.json()["message"]
    assert "appworld==0.1.3.post1" in response.json()["message"]


def test_task_ids_come_from_the_datasets_when_present(monkeypatch, tmp_path) -> None:
    datasets = tmp_path / "data" / "datasets"
    datasets.mkdir(parents=True)
    (datasets / "dev.txt").write_text("50e1ac9_1\n50e1ac9_2:tagged\n\n")
    monkeypatch.setenv("APPWORLD_ROOT", str(tmp_path))
    splits = appworld_env._splits()
    assert splits["dev"] == ["50e1ac9_1", "50e1ac9_2"]
    assert splits["train"] == [f"train-{i}" for i in range(90)]
    assert AppWorldEnv().evaluate() == (0.0, False)
