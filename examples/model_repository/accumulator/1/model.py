"""Running sum per sequence: START resets it, END forgets it. State lives in the instance, which the
sequence batcher keeps fixed for all requests of one correlation ID."""

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.sums = {}

    def execute(self, requests):
        responses = []
        for request in requests:
            value = int(pb_utils.get_input_tensor_by_name(request, "VALUE").as_numpy().reshape(-1)[0])
            start = int(pb_utils.get_input_tensor_by_name(request, "START").as_numpy().reshape(-1)[0])
            end = int(pb_utils.get_input_tensor_by_name(request, "END").as_numpy().reshape(-1)[0])
            corrid = int(pb_utils.get_input_tensor_by_name(request, "CORRID").as_numpy().reshape(-1)[0])
            if start:
                self.sums[corrid] = 0
            if corrid not in self.sums:
                responses.append(
                    pb_utils.InferenceResponse(
                        error=pb_utils.TritonError(f"sequence {corrid} is unknown to this instance")
                    )
                )
                continue
            self.sums[corrid] += value
            total = np.array([[self.sums[corrid]]], dtype=np.int32)
            if end:
                del self.sums[corrid]
            responses.append(pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("SUM", total)]))
        return responses
