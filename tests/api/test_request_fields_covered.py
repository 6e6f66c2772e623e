"""Every request field the api accepts is exercised by a test, or is refused (or asks for
nothing) and a test checks that: a field added to a request model without a test fails here.

The walk starts at each route's request model and follows every pydantic model a field can
hold. A field is named ``Model.field`` (its wire name: the alias where it has one); the models
of api/openai/responses.py carry a ``responses.`` prefix, since two of them share a name with
chat's.
Each name maps to the tests that exercise it, as ``file.py::test_function`` in tests/api/;
those tests must exist, and must mention the field (in their body, or in a module-level table
or helper they use), so a renamed, deleted or rewritten test fails here too.
"""

from __future__ import annotations

import ast
import re
import typing
from pathlib import Path

from pydantic import BaseModel

from tokenline.api.openai.chat import ChatCompletionRequest
from tokenline.api.openai.completions import CompletionRequest
from tokenline.api.openai.pooling import (
    ClassifyRequest,
    EmbeddingRequest,
    RerankRequest,
    ScoreRequest,
)
from tokenline.api.openai.responses import ResponsesRequest
from tokenline.api.openai.tokenize import DetokenizeRequest, TokenizeRequest

TESTS = Path(__file__).parent
ROOTS = (ChatCompletionRequest, CompletionRequest, ResponsesRequest, TokenizeRequest)
ROOTS += (DetokenizeRequest,)
ROOTS += (EmbeddingRequest, RerankRequest, ScoreRequest, ClassifyRequest)

CLIENT = "test_openai_client.py"
SURFACE = "test_openai_surface.py"
STRUCTURED = "test_structured_outputs.py"
LOGPROBS = "test_logprobs.py"
LIMITS = "test_limits.py"
RESPONSES = "test_responses.py"
TOKENIZE = "test_tokenize.py"
AGENTS = "test_agent_requests.py"
EMBEDDINGS = "test_embeddings_live.py"
RERANK = "test_rerank_live.py"
CLASSIFY = "test_classify_live.py"


def t(file: str, *names: str) -> tuple[str, ...]:
    return tuple(f"{file}::{name}" for name in names)


# ── fields that do something, and the tests that show it ──────────────────────────────────────
_GREEDY_FORMS = t(SURFACE, "test_top_k_1_min_p_1_and_a_tiny_top_p_are_greedy")
_TOOLS = t(STRUCTURED, "test_required_tool_choice_gives_calls_that_validate")
_TOOL_TURN = t(
    STRUCTURED,
    "test_tool_turns_render_through_the_chat_template",
    "test_a_tool_result_continues_the_conversation",
)
_NAMED = t(STRUCTURED, "test_a_named_function_is_the_one_called_once_without_parallel_calls")
_ROUND_TRIP = t(RESPONSES, "test_a_function_call_round_trip")
_ITEMS = t(RESPONSES, "test_item_input_and_instructions_reach_the_prompt")
_RESPONSE_JSON = t(RESPONSES, "test_json_schema_output_parses_and_validates")
_CHAT_COUNT = t(TOKENIZE, "test_chat_count_is_a_chat_completions_prompt_tokens")
_NOTHING_EFFORT = t(SURFACE, "test_fields_with_no_effect_refuse_values_that_ask_for_something")

REASONING = "test_reasoning_replies.py"
_THINKING = t(REASONING, "test_thinking_switched_off_in_the_template_answers_plainly")
_HISTORY = t(REASONING, "test_an_assistant_turn_goes_back_with_its_reasoning_under_either_name")

TENANTS = "test_tenants.py"
_PRIORITY = t(TENANTS, "test_priority_and_tenant_reach_the_ring") + t(
    TENANTS, "test_priority_is_refused_under_fcfs_and_bounded"
)

DISAGGREGATION = "test_disaggregation_live.py"
_KV_TRANSFER = t(DISAGGREGATION, "test_disaggregated_output_is_one_stacks") + t(
    DISAGGREGATION, "test_kv_transfer_params_on_a_plain_stack_are_refused"
)

_EMBED = t(EMBEDDINGS, "test_openai_client_float_and_base64_equal_sentence_transformers")
_EMBED_IDS = t(EMBEDDINGS, "test_token_id_inputs_and_matryoshka_dimensions")
_UNKNOWN_POOLING_MODEL = t(EMBEDDINGS, "test_an_unknown_model_is_a_404_on_every_pooling_endpoint")
_COSINES = t(EMBEDDINGS, "test_rerank_and_score_on_an_embedding_model_are_cosines")
_RERANKED = t(RERANK, "test_rerank_order_and_scores_are_the_cross_encoders")
_RERANK_TOP_N = t(RERANK, "test_rerank_top_n_and_documents_left_out")
_SCORED = t(RERANK, "test_score_one_to_many_and_pairwise")
_CLASSIFIED = t(CLASSIFY, "test_probs_and_labels_are_transformers_softmax")
_CLASSIFY_USER_MODEL = t(CLASSIFY, "test_a_user_id_is_accepted_and_an_unknown_model_is_a_404")

EXERCISED: dict[str, tuple[str, ...]] = {
    "ChatCompletionRequest.kv_transfer_params": _KV_TRANSFER,
    "CompletionRequest.kv_transfer_params": _KV_TRANSFER,
    "responses.ResponsesRequest.kv_transfer_params": _KV_TRANSFER,
    "ChatCompletionRequest.priority": _PRIORITY,
    "CompletionRequest.priority": _PRIORITY,
    "responses.ResponsesRequest.priority": _PRIORITY,
    "ChatCompletionRequest.reasoning_effort": t(
        REASONING, "test_reasoning_effort_reaches_the_chat_template"
    )
    + _NOTHING_EFFORT,
    "ChatCompletionRequest.add_generation_prompt": t(
        "test_tokenize.py", "test_a_chat_completion_renders_the_same_flags_as_tokenize"
    ),
    "ChatCompletionRequest.continue_final_message": t(
        "test_tokenize.py", "test_a_chat_completion_renders_the_same_flags_as_tokenize"
    ),
    "ChatCompletionRequest.include_reasoning": t(
        REASONING, "test_include_reasoning_false_leaves_the_thinking_out_but_counts_it"
    ),
    "ChatCompletionRequest.chat_template_kwargs": _THINKING
    + t(REASONING, "test_template_kwargs_that_would_override_the_server_are_refused"),
    "TokenizeRequest.chat_template_kwargs": t(
        REASONING,
        "test_tokenize_counts_a_chat_with_its_template_kwargs_as_the_completion_does",
    ),
    "ChatMessageIn.reasoning": _HISTORY,
    "ChatMessageIn.reasoning_content": _HISTORY,
    # ── chat completions ──
    "ChatCompletionRequest.model": t(SURFACE, "test_an_unknown_model_is_404_on_chat")
    + t(CLIENT, "test_chat_non_streaming_reports_real_usage"),
    "ChatCompletionRequest.max_tokens": t(CLIENT, "test_chat_non_streaming_reports_real_usage"),
    "ChatCompletionRequest.temperature": t(
        LOGPROBS, "test_chat_logprobs_one_entry_per_token_greedy_is_top_one"
    )
    + _GREEDY_FORMS,
    "ChatCompletionRequest.top_p": _GREEDY_FORMS,
    "ChatCompletionRequest.top_k": _GREEDY_FORMS,
    "ChatCompletionRequest.min_p": _GREEDY_FORMS,
    "ChatCompletionRequest.n": t(CLIENT, "test_n_2_returns_two_choices")
    + t(STRUCTURED, "test_every_choice_of_n_validates"),
    "ChatCompletionRequest.stream": t(CLIENT, "test_chat_streaming_chunks_follow_openai"),
    "ChatCompletionRequest.stream_options": t(CLIENT, "test_chat_streaming_chunks_follow_openai")
    + t(SURFACE, "test_include_usage_sends_null_usage_then_a_last_chunk_with_it"),
    "StreamOptions.include_usage": t(
        SURFACE, "test_include_usage_sends_null_usage_then_a_last_chunk_with_it"
    ),
    "StreamOptions.continuous_usage_stats": t(
        SURFACE, "test_continuous_usage_stats_put_the_usage_so_far_on_every_chunk"
    ),
    "ChatCompletionRequest.stop": t(
        LOGPROBS, "test_stop_string_keeps_logprobs_through_the_matching_token"
    ),
    "ChatCompletionRequest.seed": t(SURFACE, "test_a_chat_seed_repeats_a_sampled_reply"),
    "ChatCompletionRequest.presence_penalty": t(
        SURFACE, "test_penalties_change_a_repetitive_greedy_reply"
    ),
    "ChatCompletionRequest.frequency_penalty": t(
        SURFACE, "test_penalties_change_a_repetitive_greedy_reply"
    ),
    "ChatCompletionRequest.repetition_penalty": t(
        SURFACE, "test_penalties_change_a_repetitive_greedy_reply"
    ),
    "ChatCompletionRequest.skip_special_tokens": t(
        CLIENT, "test_skip_special_tokens_false_shows_them"
    ),
    "ChatCompletionRequest.include_stop_str_in_output": t(
        CLIENT, "test_include_stop_str_in_output_keeps_the_stop_string_and_the_stop_token"
    ),
    "ChatCompletionRequest.ignore_eos": t(
        SURFACE, "test_ignore_eos_and_min_tokens_hold_off_the_end_of_text"
    ),
    "ChatCompletionRequest.min_tokens": t(
        SURFACE, "test_ignore_eos_and_min_tokens_hold_off_the_end_of_text"
    ),
    "ChatCompletionRequest.stop_token_ids": t(
        SURFACE, "test_a_stop_token_id_ends_the_choice_that_draws_it"
    ),
    "ChatCompletionRequest.logit_bias": t(
        SURFACE,
        "test_logit_bias_moves_a_greedy_choice",
        "test_a_logit_bias_outside_the_vocabulary_is_refused_by_the_scheduler",
    ),
    "ChatCompletionRequest.messages": t(CLIENT, "test_chat_non_streaming_reports_real_usage")
    + t(LIMITS, "test_each_limit_is_a_400_naming_the_param_and_the_flag"),
    "ChatMessageIn.role": t(SURFACE, "test_a_developer_message_is_a_system_message") + _TOOL_TURN,
    "ChatMessageIn.content": t(SURFACE, "test_text_parts_are_joined_with_a_newline")
    + t(LIMITS, "test_a_lone_surrogate_in_any_string_is_400_naming_the_param"),
    "ContentPart.type": t(
        SURFACE,
        "test_text_parts_are_joined_with_a_newline",
        "test_a_non_text_part_is_refused_naming_its_type_and_place",
    ),
    "ContentPart.text": t(
        SURFACE,
        "test_text_parts_are_joined_with_a_newline",
        "test_a_text_part_without_text_is_refused",
    ),
    "ChatMessageIn.tool_calls": _TOOL_TURN,
    "ToolCallIn.id": _TOOL_TURN,
    "ToolCallIn.type": _TOOL_TURN,
    "ToolCallIn.function": _TOOL_TURN,
    "ToolCallFunctionIn.name": _TOOL_TURN,
    "ToolCallFunctionIn.arguments": t(
        STRUCTURED, "test_tool_turns_render_through_the_chat_template"
    )
    + t(AGENTS, "test_non_json_arguments_in_history_are_accepted_and_rendered_as_text"),
    "ChatMessageIn.tool_call_id": _TOOL_TURN,
    "ChatCompletionRequest.max_completion_tokens": t(
        SURFACE, "test_max_completion_tokens_bounds_a_chat_reply_over_max_tokens"
    )
    + t(LIMITS, "test_each_limit_is_a_400_naming_the_param_and_the_flag"),
    "ChatCompletionRequest.logprobs": t(
        LOGPROBS,
        "test_chat_logprobs_one_entry_per_token_greedy_is_top_one",
        "test_logprobs_false_is_like_not_asking",
    ),
    "ChatCompletionRequest.top_logprobs": t(
        LOGPROBS,
        "test_chat_logprobs_one_entry_per_token_greedy_is_top_one",
        "test_top_logprobs_without_logprobs_is_400",
        "test_out_of_range_logprobs_are_400_with_the_param_named",
    ),
    "ChatCompletionRequest.response_format": t(
        STRUCTURED, "test_parse_returns_a_pydantic_object", "test_json_object_output_parses"
    ),
    "ResponseFormat.type": t(STRUCTURED, "test_json_object_output_parses")
    + t(SURFACE, "test_response_format_text_is_free_text"),
    "ResponseFormat.json_schema": t(STRUCTURED, "test_completions_take_a_response_format"),
    "JsonSchemaFormat.name": t(STRUCTURED, "test_completions_take_a_response_format"),
    "JsonSchemaFormat.description": t(
        SURFACE, "test_a_json_schema_format_with_description_and_strict_is_served"
    ),
    "JsonSchemaFormat.schema": t(
        STRUCTURED,
        "test_completions_take_a_response_format",
        "test_bad_structured_input_is_refused_naming_the_param",
    ),
    "JsonSchemaFormat.strict": t(
        SURFACE, "test_a_json_schema_format_with_description_and_strict_is_served"
    ),
    "ChatCompletionRequest.tools": _TOOLS
    + t(STRUCTURED, "test_tools_shown_to_the_model_lengthen_the_prompt"),
    "Tool.type": _TOOLS,
    "Tool.function": _TOOLS,
    "FunctionDefinition.name": _TOOLS
    + t(STRUCTURED, "test_bad_structured_input_is_refused_naming_the_param"),
    "FunctionDefinition.description": _TOOLS,
    "FunctionDefinition.parameters": _TOOLS
    + t(STRUCTURED, "test_bad_structured_input_is_refused_naming_the_param"),
    "FunctionDefinition.strict": t(
        SURFACE, "test_a_strict_function_is_called_with_valid_arguments"
    ),
    "ChatCompletionRequest.tool_choice": _TOOLS
    + _NAMED
    + t(STRUCTURED, "test_tool_choice_none_keeps_the_tools_from_the_model"),
    "NamedToolChoice.type": _NAMED,
    "NamedToolChoice.function": _NAMED,
    "NamedFunction.name": _NAMED
    + t(STRUCTURED, "test_bad_structured_input_is_refused_naming_the_param"),
    "ChatCompletionRequest.parallel_tool_calls": _NAMED,
    # ── completions ──
    "CompletionRequest.model": t(CLIENT, "test_unknown_model_is_404"),
    "CompletionRequest.max_tokens": t(
        SURFACE,
        "test_a_list_of_prompts_gives_n_choices_each_in_prompt_order",
        "test_max_tokens_0_with_echo_and_logprobs_scores_the_prompt_only",
    ),
    "CompletionRequest.temperature": t(
        LOGPROBS, "test_completions_logprobs_lists_line_up_with_the_tokens"
    )
    + _GREEDY_FORMS,
    "CompletionRequest.top_p": _GREEDY_FORMS,
    "CompletionRequest.top_k": _GREEDY_FORMS,
    "CompletionRequest.min_p": _GREEDY_FORMS,
    "CompletionRequest.n": t(CLIENT, "test_n_2_returns_two_choices")
    + t(SURFACE, "test_a_list_of_prompts_gives_n_choices_each_in_prompt_order"),
    "CompletionRequest.stream": t(CLIENT, "test_completions_streaming_and_not"),
    "CompletionRequest.stream_options": t(
        SURFACE,
        "test_include_usage_sends_null_usage_then_a_last_chunk_with_it",
        "test_stream_options_need_a_stream_and_continuous_usage_needs_include_usage",
    ),
    "CompletionRequest.stop": t(CLIENT, "test_stop_string_cuts_exactly_and_ends_with_stop"),
    "CompletionRequest.seed": t(CLIENT, "test_same_seed_same_text_and_other_seed_differs"),
    "CompletionRequest.presence_penalty": t(
        SURFACE, "test_penalties_change_a_repetitive_greedy_reply"
    ),
    "CompletionRequest.frequency_penalty": t(
        SURFACE, "test_penalties_change_a_repetitive_greedy_reply"
    ),
    "CompletionRequest.repetition_penalty": t(
        SURFACE, "test_penalties_change_a_repetitive_greedy_reply"
    ),
    "CompletionRequest.skip_special_tokens": t(CLIENT, "test_skip_special_tokens_false_shows_them"),
    "CompletionRequest.include_stop_str_in_output": t(
        CLIENT, "test_include_stop_str_in_output_keeps_the_stop_string_and_the_stop_token"
    ),
    "CompletionRequest.ignore_eos": t(
        SURFACE, "test_ignore_eos_and_min_tokens_hold_off_the_end_of_text"
    ),
    "CompletionRequest.min_tokens": t(
        SURFACE, "test_ignore_eos_and_min_tokens_hold_off_the_end_of_text"
    )
    + t(CLIENT, "test_penalties_and_min_tokens_are_served"),
    "CompletionRequest.stop_token_ids": t(
        SURFACE, "test_a_stop_token_id_ends_the_choice_that_draws_it"
    )
    + t(CLIENT, "test_stop_token_id_outside_the_vocabulary_is_400"),
    "CompletionRequest.logit_bias": t(
        SURFACE,
        "test_logit_bias_moves_a_greedy_choice",
        "test_a_bad_logit_bias_is_refused_naming_it",
        "test_a_logit_bias_outside_the_vocabulary_is_refused_by_the_scheduler",
    ),
    "CompletionRequest.prompt": t(
        SURFACE,
        "test_token_id_prompts_complete_as_their_text",
        "test_a_list_of_prompts_gives_n_choices_each_in_prompt_order",
        "test_an_empty_prompt_list_is_refused",
    ),
    "CompletionRequest.response_format": t(STRUCTURED, "test_completions_take_a_response_format"),
    "CompletionRequest.echo": t(
        SURFACE,
        "test_echo_puts_the_prompt_in_front",
        "test_echo_gives_each_choice_its_own_prompt_and_stop_strings_skip_it",
        "test_echo_with_logprobs_scores_the_prompt_first",
    ),
    "CompletionRequest.logprobs": t(
        LOGPROBS, "test_completions_logprobs_lists_line_up_with_the_tokens"
    )
    + t(SURFACE, "test_echo_with_logprobs_scores_the_prompt_first"),
    "CompletionRequest.best_of": t(SURFACE, "test_best_of_must_equal_n"),
    # ── responses ──
    "responses.ResponsesRequest.model": t(
        RESPONSES, "test_text_input_gives_a_response_with_real_usage"
    ),
    "responses.ResponsesRequest.input": t(
        RESPONSES, "test_text_input_gives_a_response_with_real_usage"
    )
    + _ITEMS,
    "responses.InputItem.type": _ROUND_TRIP
    + t(RESPONSES, "test_unserved_fields_are_refused_naming_the_param"),
    "responses.InputItem.role": _ITEMS
    + t(RESPONSES, "test_invalid_fields_are_refused_naming_the_param"),
    "responses.InputItem.content": _ITEMS,
    "responses.InputItem.status": t(
        RESPONSES, "test_an_unfinished_last_message_is_continued_not_answered"
    ),
    "responses.ContentPart.type": _ITEMS
    + t(RESPONSES, "test_unserved_fields_are_refused_naming_the_param"),
    "responses.ContentPart.text": _ITEMS,
    "responses.ContentPart.refusal": t(
        SURFACE, "test_responses_refusal_parts_and_a_format_description_are_read"
    ),
    "responses.InputItem.call_id": _ROUND_TRIP
    + t(RESPONSES, "test_invalid_fields_are_refused_naming_the_param"),
    "responses.InputItem.name": _ROUND_TRIP,
    "responses.InputItem.arguments": _ROUND_TRIP
    + t(AGENTS, "test_non_json_arguments_in_history_are_accepted_and_rendered_as_text"),
    "responses.InputItem.output": _ROUND_TRIP,
    "responses.ResponsesRequest.instructions": _ITEMS,
    "responses.ResponsesRequest.max_output_tokens": t(
        RESPONSES, "test_max_output_tokens_ends_incomplete"
    ),
    "responses.ResponsesRequest.temperature": _ITEMS,
    "responses.ResponsesRequest.top_p": _ITEMS,
    "responses.ResponsesRequest.stream": t(
        RESPONSES, "test_stream_events_come_in_order_and_join_to_the_final_text"
    ),
    "responses.ResponsesRequest.tools": _ROUND_TRIP,
    "responses.FunctionToolIn.type": _ROUND_TRIP
    + t(RESPONSES, "test_unserved_fields_are_refused_naming_the_param"),
    "responses.FunctionToolIn.name": _ROUND_TRIP,
    "responses.FunctionToolIn.description": _ROUND_TRIP,
    "responses.FunctionToolIn.parameters": _ROUND_TRIP
    + t(RESPONSES, "test_invalid_fields_are_refused_naming_the_param"),
    "responses.FunctionToolIn.strict": _ROUND_TRIP,
    "responses.ResponsesRequest.tool_choice": _ROUND_TRIP,
    "responses.ResponsesRequest.parallel_tool_calls": _ROUND_TRIP
    + t(RESPONSES, "test_a_streamed_call_is_the_one_in_the_final_response"),
    "responses.ResponsesRequest.text": _RESPONSE_JSON,
    "responses.TextConfig.format": _RESPONSE_JSON,
    "responses.TextFormat.type": _RESPONSE_JSON,
    "responses.TextFormat.name": _RESPONSE_JSON
    + t(RESPONSES, "test_invalid_fields_are_refused_naming_the_param"),
    "responses.TextFormat.description": t(
        SURFACE, "test_responses_refusal_parts_and_a_format_description_are_read"
    ),
    "responses.TextFormat.schema": _RESPONSE_JSON,
    "responses.TextFormat.strict": _RESPONSE_JSON,
    "responses.ResponsesRequest.metadata": _ITEMS,
    # ── tokenize, detokenize ──
    "TokenizeRequest.model": _CHAT_COUNT + t(TOKENIZE, "test_an_unknown_model_is_a_404_on_both"),
    "TokenizeRequest.prompt": t(TOKENIZE, "test_prompt_count_is_a_completions_prompt_tokens"),
    "TokenizeRequest.messages": _CHAT_COUNT,
    "TokenizeRequest.add_special_tokens": t(
        SURFACE, "test_tokenize_add_special_tokens_counts_as_the_tokenizer_does"
    ),
    "TokenizeRequest.add_generation_prompt": t(TOKENIZE, "test_chat_flags_change_what_is_counted"),
    "TokenizeRequest.continue_final_message": t(TOKENIZE, "test_chat_flags_change_what_is_counted"),
    "TokenizeRequest.tools": t(
        TOKENIZE, "test_chat_count_with_tools_is_a_chat_completions_prompt_tokens"
    ),
    "TokenizeRequest.return_token_strs": t(TOKENIZE, "test_detokenize_undoes_tokenize"),
    "DetokenizeRequest.model": t(
        TOKENIZE, "test_detokenize_undoes_tokenize", "test_an_unknown_model_is_a_404_on_both"
    ),
    "DetokenizeRequest.tokens": t(
        TOKENIZE, "test_detokenize_undoes_tokenize", "test_detokenize_refuses_an_out_of_vocab_id"
    ),
    # ── embeddings, rerank, score, classify (a --runner pooling model) ──
    "EmbeddingRequest.model": _EMBED + _UNKNOWN_POOLING_MODEL,
    "EmbeddingRequest.input": _EMBED + _EMBED_IDS + t(EMBEDDINGS, "test_limits_and_context_length"),
    "EmbeddingRequest.encoding_format": _EMBED,
    "EmbeddingRequest.dimensions": _EMBED_IDS,
    "RerankRequest.model": _RERANKED + _UNKNOWN_POOLING_MODEL,
    "RerankRequest.query": _RERANKED + _COSINES,
    "RerankRequest.documents": _RERANKED + _RERANK_TOP_N + _COSINES,
    "Document.text": _RERANK_TOP_N,
    "RerankRequest.top_n": _RERANK_TOP_N + _COSINES,
    "RerankRequest.return_documents": _RERANK_TOP_N,
    "ScoreRequest.model": _SCORED + _UNKNOWN_POOLING_MODEL,
    "ScoreRequest.text_1": _SCORED + _COSINES,
    "ScoreRequest.text_2": _SCORED + _COSINES,
    "ClassifyRequest.model": _CLASSIFIED + _CLASSIFY_USER_MODEL,
    "ClassifyRequest.input": _CLASSIFIED + t(CLASSIFY, "test_one_text_and_token_ids"),
}

# ── fields that are refused, or accepted only where they ask for nothing ─────────────────────
_NOTHING = t(SURFACE, "test_fields_that_ask_for_nothing_are_accepted")
_NOT_STORED = t(SURFACE, "test_store_true_and_other_service_tiers_are_refused")
_NO_EFFECT_REFUSALS = t(SURFACE, "test_fields_with_no_effect_refuse_values_that_ask_for_something")
_ASSISTANT_ECHO = t(
    SURFACE,
    "test_an_assistant_message_goes_back_as_the_client_returned_it",
    "test_a_non_empty_refusal_audio_or_function_call_is_refused",
)
_UNSERVED = t(RESPONSES, "test_unserved_fields_are_refused_naming_the_param")
_RESPONSES_NOTHING = t(SURFACE, "test_responses_fields_that_ask_for_nothing_are_accepted")

REFUSED_OR_NO_OP: dict[str, tuple[str, ...]] = {
    "ChatCompletionRequest.user": _NOTHING,
    "ChatCompletionRequest.store": _NOTHING + _NOT_STORED,
    "ChatCompletionRequest.service_tier": _NOTHING + _NOT_STORED,
    **{
        f"ChatCompletionRequest.{field}": _NOTHING + _NO_EFFECT_REFUSALS
        for field in (
            "metadata",
            "modalities",
            "prediction",
            "audio",
            "web_search_options",
        )
    },
    "ChatCompletionRequest.prompt_cache_key": _NOTHING,
    "ChatCompletionRequest.safety_identifier": _NOTHING,
    "CompletionRequest.user": _NOTHING,
    "CompletionRequest.store": _NOTHING + _NOT_STORED,
    "CompletionRequest.service_tier": _NOTHING + _NOT_STORED,
    "CompletionRequest.suffix": t(SURFACE, "test_suffix_is_refused_unless_empty"),
    "ChatCompletionRequest.functions": t(
        STRUCTURED, "test_bad_structured_input_is_refused_naming_the_param"
    ),
    "ChatCompletionRequest.function_call": t(
        STRUCTURED, "test_bad_structured_input_is_refused_naming_the_param"
    ),
    "ChatMessageIn.refusal": _ASSISTANT_ECHO,
    "ChatMessageIn.audio": _ASSISTANT_ECHO,
    "ChatMessageIn.function_call": _ASSISTANT_ECHO,
    "ChatMessageIn.annotations": t(
        SURFACE,
        "test_an_assistant_message_goes_back_as_the_client_returned_it",
        "test_annotations_must_be_a_list",
    ),
    # every role's reaches the template, as vLLM hands it (tests/tokenizer checks it there)
    "ChatMessageIn.name": (
        *t(SURFACE, "test_a_name_on_a_user_message_is_accepted"),
        *t(
            "../tokenizer/test_template_messages.py",
            "test_every_roles_name_and_empty_arguments_reach_the_template_as_vllm_hands_them",
        ),
    ),
    "responses.ResponsesRequest.store": t(RESPONSES, "test_store_is_accepted_and_answered_false"),
    "responses.ResponsesRequest.user": _RESPONSES_NOTHING,
    "responses.ResponsesRequest.safety_identifier": _RESPONSES_NOTHING,
    "responses.ResponsesRequest.prompt_cache_key": _RESPONSES_NOTHING,
    "responses.ResponsesRequest.service_tier": _UNSERVED + _RESPONSES_NOTHING,
    "responses.ResponsesRequest.truncation": _UNSERVED + _RESPONSES_NOTHING,
    "responses.ResponsesRequest.reasoning": _UNSERVED
    + _RESPONSES_NOTHING
    + t(REASONING, "test_responses_stream_the_thinking_as_a_reasoning_item_before_the_answer"),
    "responses.ResponsesRequest.include": _UNSERVED + _RESPONSES_NOTHING,
    "responses.ResponsesRequest.background": _UNSERVED + _RESPONSES_NOTHING,
    "responses.ResponsesRequest.previous_response_id": _UNSERVED
    + t(RESPONSES, "test_the_official_client_sees_the_storage_refusal"),
    "responses.ResponsesRequest.conversation": _UNSERVED,
    "responses.ResponsesRequest.stream_options": _UNSERVED + _RESPONSES_NOTHING,
    "responses.StreamOptions.include_obfuscation": _UNSERVED + _RESPONSES_NOTHING,
    "responses.TextConfig.verbosity": _UNSERVED,
    "responses.FunctionToolIn.defer_loading": _UNSERVED,
    "responses.FunctionToolIn.allowed_callers": _UNSERVED,
    "responses.FunctionToolIn.output_schema": _UNSERVED,
    # OpenAI's end-user id: accepted, not used
    "EmbeddingRequest.user": t(EMBEDDINGS, "test_a_user_id_is_accepted_and_changes_nothing"),
    "ClassifyRequest.user": _CLASSIFY_USER_MODEL,
}

# Models that do not forbid unknown fields, and the tests that check what happens to them.
OPEN_MODELS: dict[str, tuple[str, ...]] = {
    # allowed so that a non-text part reaches the check that names its type; a text part's
    # unknown fields are then refused by name
    "ContentPart": t(
        SURFACE,
        "test_a_non_text_part_is_refused_naming_its_type_and_place",
        "test_an_unknown_field_in_a_text_part_is_refused",
    ),
    # kept, so that `refuse_unserved` names each one
    "responses.ResponsesRequest": _UNSERVED
    + t(SURFACE, "test_responses_refuse_unknown_fields_by_name"),
    "responses.StreamOptions": t(SURFACE, "test_responses_refuse_unknown_fields_by_name"),
    "responses.TextConfig": t(SURFACE, "test_responses_refuse_unknown_fields_by_name"),
    "responses.FunctionToolIn": t(SURFACE, "test_responses_refuse_unknown_fields_by_name"),
    # output items sent back carry ids and statuses that have no bearing on the prompt
    "responses.InputItem": _ROUND_TRIP,
    "responses.ContentPart": _ITEMS,  # an output_text part's annotations
}


# ── the walk ──────────────────────────────────────────────────────────────────────────────────
def _label(model: type[BaseModel]) -> str:
    prefix = "responses." if model.__module__.startswith("tokenline.api.openai.responses") else ""
    return prefix + model.__name__


def _models_in(annotation) -> list[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in typing.get_args(annotation) for m in _models_in(arg)]


def request_models() -> dict[str, type[BaseModel]]:
    """Every model a request body can hold, by label."""
    found: dict[str, type[BaseModel]] = {}
    todo = list(ROOTS)
    while todo:
        model = todo.pop()
        label = _label(model)
        if label in found:
            assert found[label] is model, f"two request models are labelled {label}"
            continue
        found[label] = model
        for info in model.model_fields.values():
            todo += _models_in(info.annotation)
    return found


def accepted_fields() -> dict[str, str]:
    """``Model.field`` -> the field's wire name, for every field of every request model."""
    fields = {}
    for label, model in request_models().items():
        for name, info in model.model_fields.items():
            wire = info.alias or name
            fields[f"{label}.{wire}"] = wire
    return fields


def test_the_walk_reaches_the_nested_models():
    labels = set(request_models())
    assert {
        "StreamOptions",
        "ChatMessageIn",
        "ContentPart",
        "ToolCallIn",
        "ToolCallFunctionIn",
        "ResponseFormat",
        "JsonSchemaFormat",
        "Tool",
        "FunctionDefinition",
        "NamedToolChoice",
        "NamedFunction",
        "responses.InputItem",
        "responses.ContentPart",
        "responses.FunctionToolIn",
        "responses.TextConfig",
        "responses.TextFormat",
        "responses.StreamOptions",
        "Document",
    } <= labels
    assert "JsonSchemaFormat.schema" in accepted_fields()  # the wire name, not `schema_`


def test_every_accepted_field_is_exercised_or_refused_by_a_test():
    missing = sorted(set(accepted_fields()) - set(EXERCISED) - set(REFUSED_OR_NO_OP))
    assert not missing, (
        f"request fields no test exercises: {missing}; write a test for each (in "
        f"tests/api/{SURFACE} if it fits nowhere else) and list it in EXERCISED, or in "
        "REFUSED_OR_NO_OP if the field is refused or asks for nothing"
    )


def test_the_registry_names_only_fields_that_exist():
    fields = set(accepted_fields())
    stale = sorted((set(EXERCISED) | set(REFUSED_OR_NO_OP)) - fields)
    assert not stale, f"the registry names fields no request model has: {stale}; remove them"
    assert all(EXERCISED.values()) and all(REFUSED_OR_NO_OP.values()), "an entry names no test"


def test_every_model_that_takes_unknown_fields_is_listed_with_its_test():
    open_models = {
        label
        for label, model in request_models().items()
        if model.model_config.get("extra") != "forbid"
    }
    assert open_models == set(OPEN_MODELS), (
        "models that take unknown fields (extra is not 'forbid') changed: "
        f"unlisted {sorted(open_models - set(OPEN_MODELS))}, "
        f"no longer open {sorted(set(OPEN_MODELS) - open_models)}; "
        "each open model needs a test of what happens to an unknown field"
    )


# ── the tests named must exist and mention the field ──────────────────────────────────────────
def _module_index(path: Path) -> tuple[str, dict[str, ast.AST]]:
    source = path.read_text()
    names: dict[str, ast.AST] = {}
    for node in ast.parse(source).body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names[node.name] = node
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                if isinstance(target, ast.Name):
                    names[target.id] = node
    return source, names


def _text_of_test(path: Path, name: str) -> str | None:
    """The test's source with the module-level tables and helpers it uses (two levels deep),
    or None when the file has no such test function."""
    source, names = _module_index(path)
    node = names.get(name)
    if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
        return None
    seen, todo, parts = {name}, [(node, 0)], []
    while todo:
        current, depth = todo.pop()
        parts.append(ast.get_source_segment(source, current) or "")
        if isinstance(current, ast.FunctionDef | ast.AsyncFunctionDef):
            parts += [ast.get_source_segment(source, d) or "" for d in current.decorator_list]
        if depth == 2:
            continue
        for used in ast.walk(current):
            if isinstance(used, ast.Name) and used.id in names and used.id not in seen:
                seen.add(used.id)
                todo.append((names[used.id], depth + 1))
    return "\n".join(parts)


def test_every_test_named_exists_and_mentions_its_field():
    fields = accepted_fields()
    problems = []
    texts: dict[str, str | None] = {}
    registries = [*EXERCISED.items(), *REFUSED_OR_NO_OP.items()]
    registries += [(label, tests) for label, tests in OPEN_MODELS.items()]
    for key, tests in registries:
        for ref in tests:
            file, _, name = ref.partition("::")
            path = TESTS / file
            if ref not in texts:
                texts[ref] = _text_of_test(path, name) if path.is_file() else None
            text = texts[ref]
            if text is None:
                problems.append(f"{key}: {ref} does not exist")
            elif key in fields and not re.search(rf"\b{re.escape(fields[key])}\b", text):
                problems.append(f"{key}: {ref} never mentions `{fields[key]}`")
    assert not problems, "\n".join(problems)
