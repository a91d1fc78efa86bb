"""From Dynamo's graph to streaming programs: AOTAutograd callbacks and graph surgery.

- ``training_compiler``: ``TrainingCompiler`` (partition: passes + plan + budget check;
  lowering to ``StreamingProgram``) and ``CompiledGraph``, the record of one compiled graph.
- ``inline_regions``: ``nested_compile_region`` calls copied in per call site.
- ``repeat_chain``: the chain of repeated-layer calls and the short copies cut from it.
- ``repeated_layers``: ``mark_repeated_layers``, marking a model's repeated layers for Dynamo.
"""
