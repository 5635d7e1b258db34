"""Results nested deeper than protobuf's decoder takes in a data part go as JSON text.

upb stops at 100 levels of messages, and an object in a data part takes three: a result
nested 33 objects deep raised DecodeError on every read of its task (GetTask, ListTasks, a
stream's final event, a push), once ``max_json_depth`` let such a result in."""

from __future__ import annotations

import json
from typing import Any

import pytest
from a2a.server.routes.common import serialize_list_tasks_response
from a2a.types import ListTasksResponse, TaskArtifactUpdateEvent
from a2a.utils.proto_utils import to_stream_response
from google.protobuf.json_format import MessageToDict

from broker.facades import a2a
from broker.remote.a2a_json import to_json
from tests.unit.test_a2a_facade import task

DEPTH_TAKEN = 32  # objects in a data part: upb's 100 levels of messages, three each


def nested(levels: int, container: type = dict) -> Any:
    value: Any = 1
    for _ in range(levels):
        value = {"a": value} if container is dict else [value]
    return value


@pytest.mark.parametrize("container", [dict, list])
def test_a_result_nested_past_the_decoders_depth_is_its_json_text_wherever_it_goes(
    container: type,
) -> None:
    deep = nested(DEPTH_TAKEN + 1, container)
    done = task("succeeded", result=deep)

    [part] = a2a.task_of(done).artifacts[0].parts
    listed = serialize_list_tasks_response(ListTasksResponse(tasks=[a2a.task_of(done)]), True)
    pushed = json.loads(a2a.push_body(done))
    final = [
        MessageToDict(to_stream_response(e))
        for e in a2a.EventMapper("t1", "task_t1").map("succeeded", done)
    ]
    [output] = a2a.EventMapper("t1", "task_t1").map("output", deep)

    assert (part.media_type, json.loads(part.text)) == (a2a.JSON_MEDIA_TYPE, deep)
    assert json.loads(listed["tasks"][0]["artifacts"][0]["parts"][0]["text"]) == deep
    assert json.loads(pushed["task"]["artifacts"][0]["parts"][0]["text"]) == deep
    assert json.loads(final[0]["artifactUpdate"]["artifact"]["parts"][0]["text"]) == deep
    assert isinstance(output, TaskArtifactUpdateEvent)
    assert json.loads(output.artifact.parts[0].text) == deep


def test_a_result_as_deep_as_the_decoder_takes_stays_data() -> None:
    deep = nested(DEPTH_TAKEN)

    [part] = a2a.task_of(task("succeeded", result=deep)).artifacts[0].parts

    assert to_json(part.data) == deep
