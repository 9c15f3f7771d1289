"""Sleeps, then echoes X: a stand-in for a model bound by something other than this CPU."""

import json
import time

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        params = json.loads(args["model_config"])["parameters"]  # a map, as in Triton
        self.sleep_s = float(params["sleep_ms"]["string_value"]) / 1e3

    def execute(self, requests):
        time.sleep(self.sleep_s)
        return [
            pb_utils.InferenceResponse(
                output_tensors=[pb_utils.Tensor("Y", pb_utils.get_input_tensor_by_name(r, "X").as_numpy())]
            )
            for r in requests
        ]
