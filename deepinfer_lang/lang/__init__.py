"""SGLang's module paths (sglang.lang.*) over deepinfer_lang: with `sys.modules["sglang"] = deepinfer_lang`,
`from sglang.lang.ir import REGEX_INT` and the like import these modules, which re-export our objects (the
same classes and functions as `deepinfer_lang.*`)."""
