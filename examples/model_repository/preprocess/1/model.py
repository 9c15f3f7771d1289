"""Scale integer readings to floats: the pre-processing step of the `pipeline` ensemble."""

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        import json

        cfg = json.loads(args["model_config"])
        out = pb_utils.get_output_config_by_name(cfg, "SCALED")
        self.dtype = pb_utils.triton_string_to_numpy(out["data_type"])

    def execute(self, requests):
        responses = []
        for request in requests:
            raw = pb_utils.get_input_tensor_by_name(request, "RAW").as_numpy()
            scaled = (raw * 0.5).astype(self.dtype)
            responses.append(pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("SCALED", scaled)]))
        return responses
